"""Retention; saves are asynchronous; the summary's params_sha256 is the hash of the final params. A bad
newest checkpoint (flipped bytes, truncated, deleted, torn, unsealed) falling back to the previous one, tiers
and storage faults: tests/test_integrity.py."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import events, run_trainer, summary

from trainer.store import event_names as E

pytestmark = pytest.mark.slow  # every test here trains end to end (fast loop: -m 'not slow')


def test_retention_keeps_the_latest_k_plus_every_jth(tmp_path):
    run = tmp_path / "run"
    overrides = ["checkpoint.every_steps=5", "checkpoint.keep_latest=2", "checkpoint.keep_every=20"]
    run_trainer(run, *overrides, "runbook.enabled=false", worker=True)
    kept = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert kept == [20, 25, 30]
    # With the spike runbook on, retention also keeps a last-known-good checkpoint older than its window.
    pinned = tmp_path / "pinned"
    run_trainer(pinned, *overrides, worker=True)
    kept = sorted(int(p.name) for p in (pinned / "checkpoints").iterdir() if p.name.isdigit())
    assert kept[-3:] == [20, 25, 30] and len(kept) == 4 and kept[0] < 20
    saved = [e["step"] for e in events(run) if e["event"] == E.CHECKPOINT_SAVED]
    assert saved == [5, 10, 15, 20, 25, 30]


def _committed_s(step_dir: Path) -> float:
    """When Orbax committed the step: its own record, written in the step directory as it commits."""
    return json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())["commit_timestamp_nsecs"] / 1e9


def test_saving_is_asynchronous_steps_go_on_while_slow_storage_commits(tmp_path, reference_run):
    """Storage that takes 3 s more to commit step 10 (fault slow_save): the loop trains on meanwhile. Steps
    logged after the save was started and before Orbax recorded the commit prove it, at any load: a
    synchronous save commits before the loop gets its next step."""
    ref = reference_run()
    run = tmp_path / "run"
    run_trainer(run, "faults=[{kind: slow_save, step: 10, seconds: 3}]", worker=True)
    evs = events(run)
    started = next(e["time"] for e in evs if e["event"] == E.CHECKPOINT_SAVED and e["step"] == 10)
    committed = _committed_s(run / "checkpoints" / "10")
    during = [e["step"] for e in evs if e["event"] == E.STEP and started < e["time"] < committed]
    print(f"save of step 10: committed {committed - started:.1f}s after the loop went on; steps meanwhile {during}")
    assert during and min(during) >= 10, (during, committed - started)
    assert summary(run)["params_sha256"] == summary(ref)["params_sha256"]  # slow storage changes nothing else


def test_params_sha256_is_the_sha256_of_the_final_params(reference_run):
    """Every bitwise test compares params_sha256: it must hash the params themselves (sha256 over each
    parameter's bytes in sorted key-path order), read back here from the final checkpoint by Orbax alone."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    run = reference_run()
    state_dir = run / "checkpoints" / str(summary(run)["final_step"]) / "state"
    reader = ocp.PyTreeCheckpointer()
    tree = reader.metadata(state_dir).item_metadata.tree
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    params = reader.restore(state_dir, args=ocp.args.PyTreeRestore(restore_args=as_numpy))["params"]
    h = hashlib.sha256()
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    for _path, leaf in sorted(leaves, key=lambda kv: jax.tree_util.keystr(kv[0])):
        h.update(np.ascontiguousarray(leaf).tobytes())
    assert len(jax.tree.leaves(params)) > 10 and summary(run)["params_sha256"] == h.hexdigest()


@pytest.mark.slow
def test_a_durable_dir_elsewhere_holds_the_run_and_every_reader_finds_it(tmp_path, reference_run):
    """checkpoint.durable_dir: the durable tier on another path than the run dir (a scratch file system beside
    a home directory). The checkpoints land there and nowhere else; a corrupt newest one is moved aside on
    that file system (a rename cannot cross one) and the resume falls back to the one before, ending bitwise
    the uninterrupted run; `checkpoints --verify` and `export` find them from the run dir alone; a resume
    naming another durable_dir is refused before anything is written."""
    from conftest import ROOT, child_env, snapshot, step_losses, trainer_cmd

    from trainer.faults import corrupt

    ref = reference_run()
    run, scratch = tmp_path / "run", tmp_path / "scratch"
    durable = scratch / "ckpts"
    where = f"checkpoint.durable_dir={durable}"
    run_trainer(run, where, "train.stop_at_step=13", worker=True)
    assert sorted(p.name for p in durable.glob("*")) == ["10", "13"] and not (run / "checkpoints").exists()
    hit = corrupt.newest(run, "flip")  # the run's durable tier found through RUN_DIR/config.yaml
    assert hit.startswith("13/state/") and (durable / hit).is_file(), hit

    before = (snapshot(run), snapshot(scratch))
    moved = subprocess.run(
        trainer_cmd(run, f"checkpoint.durable_dir={scratch / 'moved'}"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(),
    )
    lines = moved.stderr.strip().splitlines()
    assert moved.returncode == 2 and len(lines) == 1 and "checkpoint.durable_dir changed from" in lines[0], lines
    assert (snapshot(run), snapshot(scratch)) == before, "a refused resume wrote"

    run_trainer(run, where, worker=True)
    rejected = [e for e in events(run) if e["event"] == E.CHECKPOINT_REJECTED]
    assert [(e["step"], e["tier"]) for e in rejected] == [(13, "durable")], rejected
    assert [p.name.split("-")[0] for p in (scratch / "ckpts-rejected_checkpoints").glob("*")] == ["13"]
    assert summary(run)["params_sha256"] == summary(ref)["params_sha256"]
    losses, uninterrupted = step_losses(run), step_losses(ref)
    assert [k for k, v in losses.items() if len(v) > 1] == [11, 12, 13]  # retrained from 10: the same losses
    assert {k: set(v) for k, v in losses.items()} == {k: set(v) for k, v in uninterrupted.items()}

    cli = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "trainer", *a], cwd=ROOT, capture_output=True, text=True, timeout=300, env=child_env()
    )
    listed = cli("checkpoints", str(run), "--verify")
    assert listed.returncode == 0 and "ok:" in listed.stdout and " 30 " in listed.stdout, listed.stdout + listed.stderr
    exported = cli("export", str(run), "--out", str(tmp_path / "hf"))
    assert exported.returncode == 0 and f"of {durable}/30 (verified" in exported.stdout + exported.stderr, exported
