"""Bitwise resume: stopping at step k and resuming in a fresh process changes nothing, on every mesh, with
the layers scanned (the default), with gradient accumulation and with dropout (the saved PRNG key at work).
Across meshes and microbatch counts the loss curve is the same up to float rounding."""

from __future__ import annotations

import pytest
from conftest import events, run_trainer, step_losses, summary

from trainer.config import load_config
from trainer.core.worker import stack_changes, versions

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
# The curves compared across meshes and microbatch counts (uninterrupted runs).
CURVES = {
    **MESHES,
    "data8_microbatches2": [*MESHES["data8"], "train.microbatches=2"],
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
    run_trainer(run, *CASES[case], "train.stop_at_step=13", *only_k, worker=True)
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["13"]
    assert not (run / "summary.json").exists()
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
    first5 = {name: [curves[name][k][0] for k in range(1, 6)] for name in MESHES}
    rel = max(abs(a - b) / abs(b) for name in first5 for a, b in zip(first5[name], first5["data8"]))
    micro = max(abs(curves["data8_microbatches2"][k][0] - curves["data8"][k][0]) for k in range(1, 31))
    print(
        f"first 5 losses across data8/fsdp8/2x2x2: max relative difference {rel:.2e}; "
        f"microbatches 2 vs 1 (data8, 30 steps): max loss difference {micro:.2e}"
    )
    assert rel < 1e-3 and micro < 1e-3
    # Dropout draws from the saved key: a different curve, the same one on every resume (above).
    assert curves["data8_dropout"][1][0] != curves["data8"][1][0]


def test_resume_on_another_software_stack_warns_once(tmp_path):
    """run.deterministic (XLA's deterministic GPU ops) is part of the stack a checkpoint was made on, with
    the jax/jaxlib/flax/optax versions: a resume that changes it says so in an event and one stderr line."""
    run = tmp_path / "run"
    run_trainer(run, "train.stop_at_step=5", "checkpoint.every_steps=5", worker=True)
    proc = run_trainer(run, "train.stop_at_step=10", "checkpoint.every_steps=5", "run.deterministic=true", worker=True)
    changed = [e for e in events(run) if e["event"] == "stack_changed"]
    assert len(changed) == 1 and changed[0]["changes"] == ["run.deterministic False -> True"], changed
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning: resuming on another software")]
    assert len(warnings) == 1, proc.stderr[-2000:]
    assert [e["step"] for e in events(run) if e["event"] == "stopped"] == [5, 10]
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
    run_trainer(run, *MESHES["data8"], "launch.processes=2", worker=True)
    evs = events(run)
    assert [e["microbatches"] for e in evs if e["event"] == "compiled"] == [2]
    assert [e["event"] for e in evs].count("elastic_microbatches") == 1
    assert step_losses(run) == step_losses(reference_run(*CURVES["data8_microbatches2"]))
