"""A corrupt newest checkpoint is detected on load, reported, set aside, and the previous one used; retention.
The other ways a checkpoint goes bad, tiers and storage faults: tests/test_integrity.py."""

from __future__ import annotations

from conftest import events, run_trainer, step_losses, summary


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, reference_run):
    ref = reference_run()
    run = tmp_path / "run"
    run_trainer(run, "train.stop_at_step=20", worker=True)
    # Flip the bytes of every data file of step 20's state item, as a bad disk or torn copy would.
    for f in (run / "checkpoints" / "20" / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 0 and f.parent.name == "d":
            f.write_bytes(bytes(b ^ 0xFF for b in f.read_bytes()))
    run_trainer(run, worker=True)
    evs = events(run)
    rejected = [e for e in evs if e["event"] == "checkpoint_rejected"]
    assert [e["step"] for e in rejected] == [20] and "checksum mismatch" in rejected[0]["reason"], rejected
    assert [e["step"] for e in evs if e["event"] == "restore"] == [10]
    assert len(list((run / "rejected_checkpoints").iterdir())) == 1
    assert summary(run)["params_sha256"] == summary(ref)["params_sha256"]
    assert all(set(v) == set(step_losses(ref)[k]) for k, v in step_losses(run).items())


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
    saved = [e["step"] for e in events(run) if e["event"] == "checkpoint_saved"]
    assert saved == [5, 10, 15, 20, 25, 30]
