"""The batch host's guard (trainer.supervise.guard) on its own, with stand-in `squeue` and `scontrol` on PATH
that record what they are asked: it leaves a job alone while the supervisor's lease is renewed, and once the
lease stops for its stale time it marks the lost batch host suspect, writes `supervisor_lost` and requeues
the job. The guard under a real SLURM, its batch host lost: tests/test_node_loss.py."""

from __future__ import annotations

import json
import threading
import time

from trainer.store import event_names as E
from trainer.store import rundir
from trainer.store.rundir import write_json
from trainer.supervise import guard
from trainer.supervise.nodes import read_suspects

STALE_S, RENEWED_S = 1.0, 2.0


def _slurm_clients(tmp_path, monkeypatch) -> tuple:
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    for name, out in (("squeue", "RUNNING"), ("scontrol", "")):
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\necho {out}\n')
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("SLURMD_NODENAME", "n2")
    return calls


def test_the_guard_waits_out_a_renewed_lease_and_requeues_once_it_stops(tmp_path, monkeypatch):
    calls = _slurm_clients(tmp_path, monkeypatch)
    run = tmp_path / "run"
    guard.lease_path(run).parent.mkdir(parents=True)

    def renew():  # the supervisor's lease, renewed every 0.1 s for RENEWED_S, then silent
        for beat in range(int(RENEWED_S / 0.1)):
            write_json(guard.lease_path(run), {"beat": beat, "pid": 1, "node": "n1"})
            time.sleep(0.1)

    t0 = time.monotonic()
    threading.Thread(target=renew, daemon=True).start()
    assert guard.watch(run, "42", stale_s=STALE_S, poll_s=0.05) == 0
    took = time.monotonic() - t0
    assert took >= RENEWED_S + STALE_S - 0.15, f"requeued after {took:.2f}s while the lease was renewed"
    assert calls.read_text().splitlines() == ["squeue -h -j 42 -o %T", "scontrol requeue 42"]
    suspects = read_suspects(run / rundir.SUSPECT_NODES)
    assert list(suspects) == ["n1"] and "batch host" in suspects["n1"]["reason"]
    [lost] = [json.loads(line) for line in (run / rundir.EVENTS).read_text().splitlines()]
    assert (lost["event"], lost["node"], lost["guard_node"]) == (E.SUPERVISOR_LOST, "n1", "n2")
    assert lost["silent_s"] >= STALE_S
