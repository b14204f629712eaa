"""Bitwise resume: stopping at step k and resuming in a fresh process changes nothing, on every mesh, with
the layers scanned (the default), with gradient accumulation and with dropout (the saved PRNG key at work).
Across meshes and microbatch counts the loss curve is the same up to float rounding."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import MICRO, TINY, events, run_trainer, snapshot, step_losses, summary

from trainer.config import MeshConfig, load_config
from trainer.parallel.mesh import make_mesh
from trainer.store import event_names as E
from trainer.train import optim
from trainer.train.step import lower_train_step
from trainer.train.worker import stack_changes, state_spec, versions

pytestmark = pytest.mark.slow  # every test here trains end to end (fast loop: -m 'not slow')

MESHES = {
    "data8": ["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1"],
    "fsdp8": ["mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1"],
    "data2_fsdp2_tensor2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
}
# Resumed bitwise: each mesh once, with gradient accumulation or dropout (the saved PRNG key at work), or both.
# (Plain data8 and 2x2x2, and data8 with microbatches alone, are paths these three take too.)
CASES = {
    "fsdp8_microbatches2": [*MESHES["fsdp8"], "train.microbatches=2"],
    "data8_dropout": [*MESHES["data8"], "model.dropout=0.1"],
    "data2_fsdp2_tensor2_microbatches2_dropout": [
        *MESHES["data2_fsdp2_tensor2"],
        "train.microbatches=2",
        "model.dropout=0.1",
    ],
}
# The curves compared across meshes and microbatch counts (uninterrupted runs), to float rounding: relative
# differences under CURVE_RTOL (see the test for the measured ones). The tiny config's own mesh (2x2x2, every
# other module's) and the resume cases' runs serve as curves too: each run here is a compile of its own.
CURVE_RTOL = 2e-6
CURVES = {
    "data2_fsdp2_tensor2": MESHES["data2_fsdp2_tensor2"],
    "data2_fsdp2_tensor2_microbatches2": [*MESHES["data2_fsdp2_tensor2"], "train.microbatches=2"],
    "fsdp8_microbatches2": CASES["fsdp8_microbatches2"],
    "data8_dropout": CASES["data8_dropout"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_stop_and_resume_is_bit_identical(tmp_path, reference_run, case):
    ref = reference_run(*CASES[case])
    run = tmp_path / "run"
    # k = 13: not a multiple of the logging interval (5) nor of the checkpoint interval (10); with
    # keep_latest=1 the checkpoint written at k is the only one left when the fresh process starts (the
    # spike runbook, which would pin an older last-known-good checkpoint, is off for this).
    only_k = ["checkpoint.keep_latest=1", "runbook.enabled=false"]
    stopped = (run, *CASES[case], "train.stop_at_step=13", *only_k)
    run_trainer(*stopped, worker=True)
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["13"]
    assert not (run / "summary.json").exists()
    # The same command again: the run dir already holds what it asks for, so one line, exit 0, no byte
    # changed (answered before any worker starts).
    before = snapshot(run)
    again = run_trainer(*stopped, worker=True)
    assert snapshot(run) == before, "re-running a run stopped at train.stop_at_step changed its run dir"
    lines = again.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"stopped at step 13 (train.stop_at_step): checkpoint {run}/"), lines
    run_trainer(run, *CASES[case], *only_k, worker=True)
    assert summary(run)["params_sha256"] == summary(ref)["params_sha256"]
    assert summary(run)["final_loss"] == summary(ref)["final_loss"]
    resumed, uninterrupted = step_losses(run), step_losses(ref)
    assert resumed == uninterrupted and sorted(resumed) == list(range(1, 31))


def test_loss_falls_on_the_default_corpus(reference_run):
    losses = step_losses(reference_run(*MESHES["data2_fsdp2_tensor2"]))
    first, last = losses[1][0], losses[30][0]
    assert last < first - 1.0, (first, last)  # ~5.6 -> ~3.3 in 30 micro steps


def test_meshes_microbatches_and_dropout_change_the_curve_only_as_they_should(reference_run):
    curves = {name: step_losses(reference_run(*CURVES[name])) for name in CURVES}
    rel = lambda a, b, steps: max(abs(a[k][0] - b[k][0]) / abs(b[k][0]) for k in steps)  # noqa: E731
    one, two = curves["data2_fsdp2_tensor2"], curves["data2_fsdp2_tensor2_microbatches2"]
    mesh = rel(curves["fsdp8_microbatches2"], two, range(1, 6))
    micro = rel(two, one, range(1, 31))
    dropout = rel(curves["data8_dropout"], one, [1])
    print(
        f"first 5 losses, fsdp8 vs 2x2x2 (2 microbatches): max relative difference {mesh:.2e}; microbatches 2 "
        f"vs 1 (2x2x2, 30 steps): {micro:.2e}; dropout 0.1 vs none, step 1: {dropout:.2e}"
    )
    # "Up to float rounding", measured: 1.7e-7 across meshes and 2.3e-7 for 2 microbatches over 30 steps, 1-2
    # fp32 ulps (eps 1.2e-7): the same sums in another order. CURVE_RTOL (~17 ulps) leaves 8x for another CPU or
    # XLA version ordering its reductions otherwise; a change of arithmetic exceeds it: gradients rounded to bf16
    # before they are accumulated differ by 1.1e-5 (tests/mutate.py), which the old 1e-3 let through.
    assert mesh < CURVE_RTOL, mesh
    assert micro < CURVE_RTOL, micro
    # Dropout draws from the saved key: another curve (the same one on every resume, above), by far more than
    # rounding.
    assert dropout > 100 * CURVE_RTOL, dropout


def test_resume_on_another_software_stack_warns_once(tmp_path):
    """run.deterministic (XLA's deterministic GPU ops) is part of the stack a checkpoint was made on, with
    the jax/jaxlib/flax/optax versions: a resume that changes it says so in an event and one stderr line."""
    run = tmp_path / "run"
    run_trainer(run, "train.stop_at_step=5", "checkpoint.every_steps=5", worker=True)
    proc = run_trainer(run, "train.stop_at_step=10", "checkpoint.every_steps=5", "run.deterministic=true", worker=True)
    changed = [e for e in events(run) if e["event"] == E.STACK_CHANGED]
    assert len(changed) == 1 and changed[0]["changes"] == ["run.deterministic False -> True"], changed
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning: resuming on another software")]
    assert len(warnings) == 1, proc.stderr[-2000:]
    assert [e["step"] for e in events(run) if e["event"] == E.STOPPED] == [5, 10]
    meta = stack_changes(
        {
            "versions": {"jax": "0.0.1", "jaxlib": "0.0.1", **{p: versions()[p] for p in ("flax", "optax")}},
            "config": {"run": {"deterministic": True}},
        },
        load_config(None, ["run.deterministic=true"]),
    )
    assert meta == [f"jax 0.0.1 -> {versions()['jax']}", f"jaxlib 0.0.1 -> {versions()['jaxlib']}"]


def test_a_shrunk_group_keeps_its_batches_by_raising_microbatches(tmp_path, reference_run):
    """Planned for 2 processes, running as 1 (what the launcher's elastic shrink does under SLURM): the
    worker takes the global batch in 2 microbatches and trains exactly as a run configured that way."""
    run = tmp_path / "run"
    run_trainer(run, "launch.processes=2", worker=True)
    evs = events(run)
    assert [e["microbatches"] for e in evs if e["event"] == E.COMPILED] == [2]
    assert [e["event"] for e in evs].count(E.ELASTIC_MICROBATCHES) == 1
    assert step_losses(run) == step_losses(reference_run(*CURVES["data2_fsdp2_tensor2_microbatches2"]))


# XLA's cheapest CPU compile (a train step: ~3 CPU-s instead of ~7): the test below compares losses within one
# executable, never across compiles.
QUICK_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def test_each_microbatch_draws_its_own_dropout_key_and_each_step_advances_the_saved_one():
    """train.microbatches=2 with dropout, one compiled train step: swapping the batch's two slices changes
    the loss, which one key for both slices could not (the mean of two slice losses does not depend on their
    order, bit for bit). The key is state: a step leaves another one, and the same params and data under
    another key draw other masks, so a resume that lost the saved key ends elsewhere (the dropout cases of
    test_stop_and_resume_is_bit_identical)."""
    cfg = load_config(TINY, [*MICRO, "data.batch_size=4", "model.dropout=0.1", "train.microbatches=2"])
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1))
    spec = state_spec(cfg, mesh)
    step = lower_train_step(spec, mesh, cfg, microbatches=2).compile(compiler_options=QUICK_COMPILE)
    gen = np.random.default_rng(0)
    # Random params (the seeded init would be another compile); zero moments; the config's hyperparameters.
    params = jax.tree.map(lambda a: gen.normal(0, 0.1, a.shape).astype(a.dtype), spec.abstract["params"])

    def state(key):
        zeros = jax.tree.map(lambda a: jax.device_put(np.zeros(a.shape, a.dtype), a.sharding), spec.abstract)
        st = dict(zeros, params=jax.device_put(params, spec.shardings["params"]))
        st = optim.set_hyperparams(st, {"lr_scale": 1.0, "clip_norm": cfg.optim.clip_norm, "b2": cfg.optim.b2})
        return dict(st, rng=jax.device_put(key, spec.shardings["rng"]))

    tokens = gen.integers(0, 256, (4, cfg.model.seq_len + 1), dtype=np.int32)
    batch = lambda rows: jax.device_put(tokens[rows], step.input_shardings[0][1])  # noqa: E731
    key0 = np.asarray(jax.random.key_data(jax.random.key(0)))
    lr = np.float32(cfg.optim.lr)
    st1, ab = step(state(key0), batch([0, 1, 2, 3]), lr)
    # Microbatch i is rows i, i+2: [1, 0, 3, 2] trades the two slices' places, each slice's rows unchanged.
    _, ba = step(state(key0), batch([1, 0, 3, 2]), lr)
    assert float(ab["loss"]) != float(ba["loss"]), "the two microbatches drew the same dropout mask"
    key1 = np.asarray(st1["rng"])
    assert not np.array_equal(key1, key0), "a step left the PRNG key as it found it: the saved key is dead weight"
    _, with_key1 = step(state(key1), batch([0, 1, 2, 3]), lr)  # the same step, params and data
    assert float(with_key1["loss"]) != float(ab["loss"]), "the step's dropout ignores the state's key"
