"""The durable tier in an S3 bucket (checkpoint.durable_dir=s3://...), against a real S3 server on loopback:
moto's server mode, started here. Orbax stages each step in RUN_DIR/checkpoints, the sealing thread uploads
it (manifests last), a restore downloads and verifies it (trainer.ckpt.bucket)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import ROOT, child_env, events, run_trainer, step_losses, summary, trainer_cmd
from multihost import audit

BUCKET = "ckpt"


class S3Server:
    """`python -m moto.server` on a free loopback port: a real HTTP S3 endpoint (not a mock of any client)."""

    def __init__(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.url,
        }
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.url, timeout=2).read()
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"moto's S3 server did not answer on {self.url}") from None
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def make_bucket(self, name: str) -> None:
        urllib.request.urlopen(urllib.request.Request(f"{self.url}/{name}", method="PUT")).read()

    def kv(self, prefix: str):
        """A TensorStore client of the bucket (the test's own, to look at and damage objects)."""
        import tensorstore as ts

        from trainer.ckpt import bucket

        return ts.KvStore.open(bucket.spec(bucket.parse(f"s3://{BUCKET}/{prefix}"))).result()


@pytest.fixture(scope="module")
def s3():
    """The server, and its endpoint and credentials in this process's environment while the module runs (for
    the test's own client: TensorStore reads them at each request)."""
    server = S3Server()
    server.start()
    server.make_bucket(BUCKET)
    with pytest.MonkeyPatch.context() as env:
        for k, v in server.env.items():
            env.setenv(k, v)
        yield server
    server.stop()


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
    where = (f"checkpoint.durable_dir=s3://{BUCKET}/runs/a", "checkpoint.keep_latest=2", "runbook.enabled=false")
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
    rejected = [(e["step"], e["tier"], e["file"]) for e in evs if e["event"] == "checkpoint_rejected"]
    assert rejected == [(13, "durable", victim.split("/", 1)[1])], rejected
    restores = [(e["step"], e["tier"]) for e in evs if e["event"] == "restore"]
    assert restores == [(10, "durable"), (10, "durable")], restores
    assert not any(k.startswith(b"13/") for k in kv.list().result()), "the rejected step stayed in the bucket"
    assert summary(run)["params_sha256"] == summary(ref)["params_sha256"]
    losses, uninterrupted = step_losses(run), step_losses(ref)
    assert {k: set(v) for k, v in losses.items()} == {k: set(v) for k, v in uninterrupted.items()}
    audit(run)
    # retention (keep_latest=2) in the bucket as in the staging directory
    final = sorted({int(k.decode().split("/")[0]) for k in kv.list().result()})
    assert final == sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [20, 30]


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
