"""The durable tier in an S3 bucket (checkpoint.durable_dir=s3://...), against a real S3 server on loopback:
moto's server mode (tests/buckets.py, the `s3` fixture). Orbax stages each step in RUN_DIR/checkpoints, the
sealing thread uploads it (manifests last), a restore downloads and verifies it (trainer.store.bucket)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from buckets import BUCKET, Relay, until
from conftest import ROOT, child_env, events, run_trainer, step_losses, summary, trainer_cmd
from multihost import audit

from trainer.store import event_names as E


@pytest.mark.slow
def test_a_run_whose_durable_tier_is_a_bucket_resumes_from_it_bitwise_and_falls_back_past_a_flipped_byte(
    tmp_path, reference_run, s3
):
    """Stopped at 13: steps 10 and 13 are objects under the prefix, manifests included. The staging copies are
    deleted (a new node has none) and one byte of an object of 13 flipped in the bucket: the resume, SIGKILLed
    once at 17 and restarted by the supervisor, rejects 13 (deleted from the bucket), restores 10 from the
    bucket, and ends with the uninterrupted run's params, losses and an audit that passes."""
    ref = reference_run()
    run = tmp_path / "run"
    # keep_latest=2 and no runbook (its last-known-good pin would keep 10): retention has something to delete
    where = (f"checkpoint.durable_dir={s3.scheme}://{BUCKET}/runs/a", "checkpoint.keep_latest=2")
    where += ("runbook.enabled=false",)
    where += ("data.audit=true",)
    run_trainer(run, *where, "train.stop_at_step=13", worker=True, env=s3.env)
    kv = s3.kv("runs/a/")
    keys = [k.decode() for k in kv.list().result()]
    assert {k.split("/")[0] for k in keys} == {"10", "13"}, keys
    assert "13/integrity/process_0.json" in keys and any(k.startswith("13/state/") for k in keys), keys

    shutil.rmtree(run / "checkpoints")
    victim = max((k for k in keys if k.startswith("13/state/")), key=lambda k: len(kv.read(k).result().value))
    raw = bytearray(kv.read(victim).result().value)
    raw[len(raw) // 2] ^= 0x01
    kv.write(victim, bytes(raw)).result()

    kill = "faults=[{kind: signal, signal: SIGKILL, step: 17}]"
    run_trainer(run, *where, kill, env=s3.env)
    evs = events(run)
    rejected = [(e["step"], e["tier"], e["file"]) for e in evs if e["event"] == E.CHECKPOINT_REJECTED]
    assert rejected == [(13, "durable", victim.split("/", 1)[1])], rejected
    restores = [(e["step"], e["tier"]) for e in evs if e["event"] == E.RESTORE]
    assert restores == [(10, "durable"), (10, "durable")], restores
    assert not any(k.startswith(b"13/") for k in kv.list().result()), "the rejected step stayed in the bucket"
    assert summary(run)["params_sha256"] == summary(ref)["params_sha256"]
    losses, uninterrupted = step_losses(run), step_losses(ref)
    assert {k: set(v) for k, v in losses.items()} == {k: set(v) for k, v in uninterrupted.items()}
    audit(run)
    # retention (keep_latest=2) in the bucket as in the staging directory
    final = sorted({int(k.decode().split("/")[0]) for k in kv.list().result()})
    assert final == sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [20, 30]
    # export reads the bucket's newest step (downloaded: no staged copy left)
    shutil.rmtree(run / "checkpoints")
    exported = subprocess.run(
        [sys.executable, "-m", "trainer", "export", str(run), "--out", str(tmp_path / "hf")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**child_env(), **s3.env},
    )
    assert exported.returncode == 0 and "/checkpoints/30 (verified" in exported.stdout + exported.stderr, exported


@pytest.mark.slow
def test_a_step_whose_upload_was_cut_short_is_uploaded_again_not_dropped(tmp_path, s3):
    """Stopped at 13, then the bucket loses step 13's manifest (the sealing thread's last write: its process
    died uploading, as a lost node does). The staged copy is sealed on disk, so the resume uploads it again
    (`checkpoint_resealed`) and restores 13, not the 10 before it. Then step 14 (saved at that resume's stop)
    loses its manifest on disk too (its process died between Orbax's commit and its checksums): nothing
    vouches for it, so the next resume drops the staged copy (Orbax would refuse to save 14 again, and the
    run would crash-loop), restores 13 and saves 14 anew (a periodic save every 7 steps)."""
    run = tmp_path / "run"
    where = (f"checkpoint.durable_dir=s3://{BUCKET}/runs/r", "runbook.enabled=false")
    run_trainer(run, *where, "train.stop_at_step=13", worker=True, env=s3.env)
    kv = s3.kv("runs/r/")
    kv.write("13/integrity/process_0.json", None).result()  # a write of None deletes the object
    assert b"13/integrity/process_0.json" not in kv.list().result()
    run_trainer(run, *where, "train.stop_at_step=14", worker=True, env=s3.env)
    evs = events(run)
    assert [e["step"] for e in evs if e["event"] == E.CHECKPOINT_RESEALED] == [13]
    assert [(e["step"], e["tier"]) for e in evs if e["event"] == E.RESTORE] == [(13, "durable")]
    assert b"13/integrity/process_0.json" in kv.list().result()

    kv.write("14/integrity/process_0.json", None).result()
    (run / "checkpoints" / "14" / "integrity" / "process_0.json").unlink()
    again = ("train.stop_at_step=15", "checkpoint.every_steps=7")  # a save at 14 again
    proc = run_trainer(run, *where, *again, worker=True, env=s3.env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evs = events(run)
    assert [e["step"] for e in evs if e["event"] == E.CHECKPOINT_RESEALED] == [13]
    assert [(e["step"], e["tier"]) for e in evs if e["event"] == E.RESTORE] == [(13, "durable")] * 2
    assert b"14/integrity/process_0.json" in kv.list().result()


@pytest.mark.slow
def test_a_gcs_bucket_holds_the_durable_tier_and_a_resume_with_no_staged_copy_reads_it(tmp_path, reference_run, gcs):
    """The same code over GCS's JSON API (gcp-storage-emulator): stopped at 13, the staged copies deleted, the
    resume downloads 13 from the bucket and ends with the uninterrupted run's params; retention deletes there."""
    ref = reference_run()
    run = tmp_path / "run"
    where = (f"checkpoint.durable_dir=gs://{BUCKET}/runs/g", "checkpoint.keep_latest=2", "runbook.enabled=false")
    run_trainer(run, *where, "train.stop_at_step=13", worker=True, env=gcs.env)
    shutil.rmtree(run / "checkpoints")
    run_trainer(run, *where, worker=True, env=gcs.env)
    assert [(e["step"], e["tier"]) for e in events(run) if e["event"] == E.RESTORE] == [(13, "durable")]
    assert summary(run)["params_sha256"] == summary(ref)["params_sha256"]
    assert sorted({int(k.decode().split("/")[0]) for k in gcs.kv("runs/g/").list().result()}) == [20, 30]


@pytest.mark.slow
def test_an_endpoint_gone_during_a_save_is_waited_for_and_no_committed_checkpoint_is_lost(tmp_path, reference_run, s3):
    """First the bucket throttles (HTTP 503 SlowDown) the upload of step 10: retried, sealed, no failure. Then
    the endpoint goes away while step 20 commits (its storage 3 s slow: fault slow_save): the upload fails
    after checkpoint.bucket_patience_s, the worker exits as a storage failure (81), the supervisor alerts and
    waits for the bucket, restarts once it answers, uploads 20 again (sealed on disk, not in the bucket),
    resumes from it and ends with the uninterrupted run's params; every checkpoint the bucket holds at the end
    verifies."""
    ref = reference_run()
    relay = Relay(s3.port)
    relay.up()
    run = tmp_path / "run"
    over = (
        f"checkpoint.durable_dir=s3://{BUCKET}/runs/b",
        "checkpoint.bucket_patience_s=7",  # 3 retries, after 1, 2 and 4 s
        "faults=[{kind: slow_save, step: 20, seconds: 3}]",
    )
    env = {**child_env(), **s3.env, "AWS_ENDPOINT_URL": relay.url}
    proc = subprocess.Popen(trainer_cmd(run, *over), cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        until(lambda: any(e["event"] == E.STEP for e in events(run)))
        relay.throttle = 1  # the next connection (the upload of 10: its kept-alive ones are dropped) is throttled
        relay.drop_connections()
        until(lambda: any(e["event"] == E.CHECKPOINT_SAVED and e["step"] == 20 for e in events(run)))
        assert relay.throttled == 1
        relay.down()  # before the commit (3 s late) and so before the upload
        until(lambda: any(e["event"] == E.ALERT and e["kind"] == "bucket_down" for e in events(run)))
        relay.up()
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
        relay.down()
    assert proc.returncode == 0, err[-3000:]
    evs = events(run)
    [failed] = [e for e in evs if e["event"] == E.CHECKPOINT_FAILED]
    assert failed["step"] >= 20 and "s3://ckpt/runs/b/" in failed["message"], failed
    assert [e["exit_code"] for e in evs if e["event"] == E.WORKER_EXIT] == [81, 0]
    assert [e["kind"] for e in evs if e["event"] == E.ALERT_CLEARED] == ["bucket_down"]
    assert [e["step"] for e in evs if e["event"] == E.CHECKPOINT_RESEALED] == [20]
    assert [e["step"] for e in evs if e["event"] == E.RESTORE] == [20]
    assert summary(run)["params_sha256"] == summary(ref)["params_sha256"]
    listed = subprocess.run(
        [sys.executable, "-m", "trainer", "checkpoints", str(run), "--verify", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**child_env(), **s3.env},  # the server itself: the relay is down by now
    )
    found = [(e["step"], e["verified"]) for e in json.loads(listed.stdout)]
    assert listed.returncode == 0 and found == [(30, True), (20, True), (10, True)], listed.stdout + listed.stderr


def test_a_missing_bucket_is_one_line_exit_2_and_nothing_written(tmp_path, s3):
    run = tmp_path / "run"
    secret = "sekret-9f3a"
    p = subprocess.run(
        trainer_cmd(run, "checkpoint.durable_dir=s3://no-such-bucket/run"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**child_env(), **s3.env, "AWS_SECRET_ACCESS_KEY": secret},
    )
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "NoSuchBucket" in lines[0] and "create it" in lines[0], lines
    assert secret not in p.stderr + p.stdout and not run.exists()
