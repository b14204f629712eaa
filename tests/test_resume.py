"""Bitwise resume: stopping at step k and resuming in a fresh process changes nothing."""

from __future__ import annotations

import pytest
from conftest import run_trainer, step_losses, summary

MESHES = {
    "data8": ["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1"],
    "data2_fsdp2_tensor2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
}


@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_stop_and_resume_is_bit_identical(tmp_path, reference_run, mesh):
    ref = reference_run(*MESHES[mesh])
    run = tmp_path / "run"
    # k = 13: not a multiple of the logging interval (5) nor of the checkpoint interval (10); with
    # keep_latest=1 the checkpoint written at k is the only one left when the fresh process starts (the
    # spike runbook, which would pin an older last-known-good checkpoint, is off for this).
    only_k = ["checkpoint.keep_latest=1", "runbook.enabled=false"]
    run_trainer(run, *MESHES[mesh], "train.stop_at_step=13", *only_k, worker=True)
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["13"]
    assert not (run / "summary.json").exists()
    run_trainer(run, *MESHES[mesh], *only_k, worker=True)
    assert summary(run)["params_sha256"] == summary(ref)["params_sha256"]
    assert summary(run)["final_loss"] == summary(ref)["final_loss"]
    resumed, uninterrupted = step_losses(run), step_losses(ref)
    assert resumed == uninterrupted and sorted(resumed) == list(range(1, 31))


def test_loss_falls_on_the_default_corpus(reference_run):
    losses = step_losses(reference_run(*MESHES["data2_fsdp2_tensor2"]))
    first, last = losses[1][0], losses[30][0]
    assert last < first - 1.0, (first, last)  # ~5.6 -> ~3.3 in 30 micro steps
