"""Training on prepared data with the held-out eval: eval on or off trains the same bytes, the eval loss
falls, a killed run resumes bitwise, imported token files train, and a model whose vocabulary is smaller
than the tokenizer's is refused before anything is written."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import events, run_trainer, step_losses, summary, tensorboard
from corpora import code_jsonl, prepared

from trainer.store import event_names as E

pytestmark = pytest.mark.slow  # every test here trains end to end (fast loop: -m 'not slow')

EVAL = ["eval.every_steps=10", "eval.batches=2"]
DROPOUT = "model.dropout=0.1"  # the train step draws from the RNG: an eval that touched it would show


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval")
    return prepared(
        d / "bpe", "--input", code_jsonl(d / "code.jsonl", 0.6), "--tokenizer", "bpe:512", "--val-fraction", "0.1"
    )


@pytest.fixture(scope="module")
def with_eval(tmp_path_factory, bpe):
    run = tmp_path_factory.mktemp("with-eval") / "run"
    run_trainer(run, f"data.path={bpe}", "model.vocab_size=512", DROPOUT, *EVAL, worker=True)
    return run


def _evals(run) -> dict[int, dict]:
    return {e["step"]: e for e in events(run) if e["event"] == E.EVAL}


def test_eval_never_changes_training_and_its_loss_falls(tmp_path, bpe, with_eval):
    # The run without eval also runs with log.health=false and a rising ECC count: no collector, no alert.
    run_trainer(
        tmp_path / "off",
        f"data.path={bpe}",
        "model.vocab_size=512",
        DROPOUT,
        "eval.every_steps=0",
        "log.health=false",
        "faults=[{kind: ecc, step: 3}]",
        worker=True,
    )
    assert summary(with_eval)["params_sha256"] == summary(tmp_path / "off")["params_sha256"]
    assert step_losses(with_eval) == step_losses(tmp_path / "off")  # bitwise, every step
    ev = _evals(with_eval)
    assert sorted(ev) == [10, 20, 30] and not _evals(tmp_path / "off")
    assert ev[10]["loss"] > ev[20]["loss"] > ev[30]["loss"] and ev[30]["batches"] == 2
    assert math.isclose(ev[30]["perplexity"], math.exp(ev[30]["loss"]), rel_tol=1e-9)
    ready = next(e for e in events(with_eval) if e["event"] == E.DATA_READY)
    assert (ready["tokenizer"], ready["vocab_size"], ready["dir"]) == ("bpe:512", 512, str(bpe))

    tb = tensorboard(with_eval / "tb")
    assert [s.step for s in tb.Scalars("loss/eval")] == [10, 20, 30]
    from trainer.observe import runview, status

    line = next(ln for ln in status.render(runview.load(with_eval)).splitlines() if ln.startswith("eval "))
    assert f"loss {ev[30]['loss']:.4f}" in line and "at step 30" in line and f"down from {ev[20]['loss']:.4f}" in line
    # log.health=false: health collection and alerts are off (and, above, change nothing in training).
    for run, on in ((with_eval, True), (tmp_path / "off", False)):
        kinds = {e["event"] for e in events(run)}
        tags = set(tensorboard(run / "tb").Tags()["scalars"])
        assert ({E.HEALTH_SOURCE, E.HEALTH} <= kinds) == on and any(t.startswith("health/") for t in tags) == on
    off = {e["event"] for e in events(tmp_path / "off")}  # the ECC count rose from step 3 (an alert with health on)
    assert not off & {E.ALERT, E.CHECKPOINT_NOW}, off


# An eval slower than the step timeout is no hang (eval is a heartbeat phase of its own); a hung eval is
# caught by its own timeout. Then a crash.
EVAL_FAULTS = (
    "faults=[{kind: slow, step: 10, phase: eval, seconds: 7}, {kind: hang, step: 20, phase: eval}, "
    "{kind: crash, step: 27}]"
)


def test_a_killed_run_on_prepared_data_resumes_bitwise(tmp_path, bpe, with_eval):
    run = tmp_path / "run"
    timeouts = ("supervisor.step_timeout_s=4", "supervisor.eval_timeout_s=8")
    run_trainer(run, f"data.path={bpe}", "model.vocab_size=512", DROPOUT, *EVAL, EVAL_FAULTS, *timeouts)
    hangs = [(e["phase"], e["step"], e["timeout_s"]) for e in events(run) if e["event"] == E.HANG_DETECTED]
    assert hangs == [("eval", 20, 8)], hangs  # the slow eval at step 10 (7 s > the step's 4 s) was not one
    # Saves are asynchronous: on a loaded machine the one at step 20 may not be committed by step 27.
    restores = [e["step"] for e in events(run) if e["event"] == E.RESTORE]
    assert summary(run)["restarts"] == 2 and restores in ([10, 20], [10, 10]), restores
    assert summary(run)["params_sha256"] == summary(with_eval)["params_sha256"]
    assert all(set(v) == set(step_losses(with_eval)[k]) for k, v in step_losses(run).items())
    assert {k: e["loss"] for k, e in _evals(run).items()} == {k: e["loss"] for k, e in _evals(with_eval).items()}


def _tree(d) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_an_imported_token_file_trains_and_a_small_vocab_is_refused(tmp_path, bpe, with_eval):
    train = np.fromfile(bpe / "train-00000.bin", dtype=np.uint16)
    train.tofile(tmp_path / "tokens.bin")  # a flat uint16 file, as nanoGPT's prepare scripts write
    imported = prepared(
        tmp_path / "imported", "--from-tokens", tmp_path / "tokens.bin", "--dtype", "uint16", "--vocab-size", "512"
    )
    run_trainer(
        tmp_path / "run",
        f"data.path={imported}",
        "model.vocab_size=512",
        DROPOUT,  # the module's one compiled train step (the fixture's): a cache hit, not a compile
        "train.steps=5",
        "checkpoint.every_steps=0",
        worker=True,
    )
    assert summary(tmp_path / "run")["final_step"] == 5
    # The checkpoint recorded the data's fingerprint (from meta.json): a resume on other data is refused.
    before = _tree(with_eval)
    other = run_trainer(
        with_eval, f"data.path={imported}", "model.vocab_size=512", DROPOUT, "train.steps=40", check=False
    )
    assert other.returncode == 2 and "the training data changed" in other.stderr and _tree(with_eval) == before

    small = run_trainer(tmp_path / "small", f"data.path={bpe}", "model.vocab_size=384", check=False)
    assert small.returncode == 2 and not (tmp_path / "small").exists()
    assert "model.vocab_size (384) is smaller than the tokenizer's vocabulary (512, bpe:512" in small.stderr
    no_val = run_trainer(tmp_path / "noval", f"data.path={imported}", "model.vocab_size=512", *EVAL, check=False)
    assert no_val.returncode == 2 and "holds out only 0" in no_val.stderr and not (tmp_path / "noval").exists()
