"""Checkpoint integrity end to end, on real runs: a newest checkpoint with flipped bytes, a truncated, a
deleted or an unsealed file, or a torn metadata item is rejected with an event, set aside, and the run falls
back to the previous verified checkpoint and ends bitwise like an undisturbed run. Also: retention keeps
the newest sealed checkpoint, transient read errors are retried, the node-local tier, silent data
corruption caught by the replica check, and a full disk (tmpfs)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, child_env, events, run_trainer, step_losses, summary, trainer_cmd
from test_layout import _cli

from trainer.faults import corrupt
from trainer.store import ckpt_files as checkpoint_files
from trainer.store import event_names as E
from trainer.store import manifest
from trainer.store.ckpt_files import DURABLE, LOCAL
from trainer.supervise import exit_codes


def _same_as(run: Path, ref: Path, unlogged: tuple[int, ...] = ()) -> None:
    """Bitwise the reference run. `unlogged`: steps whose loss a kill right after their save may not have let
    the loop log (it logs a step's metrics when it dispatches the next one)."""
    assert summary(run)["params_sha256"] == summary(ref)["params_sha256"]
    losses, ref_losses = step_losses(run), step_losses(ref)
    assert set(ref_losses) - set(unlogged) <= set(losses) <= set(ref_losses)
    assert all(set(v) == set(ref_losses[k]) for k, v in losses.items())


def _of(run: Path, kind: str) -> list[dict]:
    return [e for e in events(run) if e["event"] == kind]


# --- a bad newest checkpoint ---------------------------------------------------------------------------


def _delete(step_dir: Path) -> str:
    f = corrupt.largest_file(step_dir / "state")
    f.unlink()
    return f.relative_to(step_dir).as_posix()


def _unseal(step_dir: Path) -> str:
    shutil.rmtree(step_dir / manifest.DIR)  # killed after Orbax's commit, before the manifest was written
    return ""


CORRUPTIONS = {
    "bytes_flipped": (corrupt.flip, "checksum mismatch"),
    "truncated": (corrupt.truncate, "truncated"),
    "deleted": (_delete, "file missing"),
    "meta_torn": (corrupt.torn, "truncated or torn"),
    "unsealed": (_unseal, "unverified"),
}


@pytest.fixture(scope="module")
def stopped_at_20(tmp_path_factory) -> Path:
    """A run stopped at step 20 with checkpoints 10, 15, 20 (and 5, the runbook's last-known-good pin)."""
    run = tmp_path_factory.mktemp("saved") / "run"
    run_trainer(run, "checkpoint.every_steps=5", "train.stop_at_step=20", worker=True)
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir()) == [5, 10, 15, 20]
    return run


@pytest.mark.slow
@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
def test_a_bad_newest_checkpoint_is_rejected_and_the_previous_one_used(tmp_path, stopped_at_20, reference_run, how):
    ref = reference_run()
    run = tmp_path / "run"
    shutil.copytree(stopped_at_20, run)
    corrupt, reason = CORRUPTIONS[how]
    bad_file = corrupt(run / "checkpoints" / "20")
    if how == "bytes_flipped":  # the jax-free listing finds it too, before any restore
        out = _cli("checkpoints", str(run), "--verify", "--json")
        listed = {e["step"]: e for e in json.loads(out.stdout)}
        assert out.returncode == 1 and not listed[20]["verified"] and bad_file in listed[20]["detail"], out.stderr
        assert all(listed[s]["verified"] for s in (5, 10, 15))
    # what was rejected and restored is asserted before the exit code: a restore that went wrong also ends
    # the run badly, and the assertion that names the wrong choice is the one to fail
    proc = run_trainer(run, "checkpoint.every_steps=5", worker=True, check=False)
    rejected = _of(run, E.CHECKPOINT_REJECTED)
    assert [(e["step"], e["tier"], e["file"]) for e in rejected] == [(20, "durable", bad_file)], rejected
    assert reason in rejected[0]["reason"], rejected
    assert [(e["step"], e["tier"]) for e in _of(run, E.RESTORE)] == [(15, "durable")]  # the previous, not the oldest
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [p.name.split("-")[0] for p in (run / checkpoint_files.REJECTED).iterdir()] == ["20"]
    _same_as(run, ref)


def test_retention_keeps_the_newest_sealed_checkpoint_until_a_newer_one_is_sealed(tmp_path):
    import jax.numpy as jnp

    from trainer.ckpt.checkpoint import Checkpointer
    from trainer.config import CheckpointConfig

    cfg = CheckpointConfig(keep_latest=1)
    state = {"w": jnp.arange(64.0)}

    def save(step: int) -> Checkpointer:
        ck = Checkpointer(tmp_path, cfg)
        ck.save(step, state, {"next_index": step}, {})
        return ck

    save(1).close()
    ck = save(2)
    ck.wait()  # committed and sealed, then killed before close: 1 is still there, 2 is the only sealed one
    shutil.rmtree(tmp_path / "2" / manifest.DIR)  # ... or killed between commit and seal: 1 is the newest sealed
    ck = save(3)  # retention while 3 is being written: keep_latest=1 keeps 3, the pin keeps 1 (2 was never sealed)
    ck.wait()
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [1, 3]
    ck.close()  # 3 is sealed now: it alone is kept
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [3]
    assert manifest.verify(tmp_path / "3") is None


def test_possibly_transient_read_errors_are_retried_and_others_are_not():
    """3 retries after 1, 2 and 4 s (README). The waits are timed around real sleeps, from below only (a sleep
    never ends early; a loaded machine only lengthens it), so no bound here can flake."""
    from trainer.ckpt import tiers

    calls: list[float] = []

    def flaky(failures: int):
        calls.append(time.perf_counter())
        if len(calls) <= failures:
            raise OSError(errno.EIO, "Input/output error")
        return "read"

    def outcome(failures: int, wait_s: float) -> str:
        calls.clear()
        try:
            return manifest.retrying(lambda: flaky(failures), wait_s=wait_s)
        except OSError:
            return "gave up"

    wait = 0.1  # the schedule's unit, scaled down from 1 s
    assert (outcome(3, wait), len(calls)) == ("read", 4), "not 3 retries by default"
    gaps = [b - a for a, b in zip(calls, calls[1:])]
    assert all(g >= wait * 2**i for i, g in enumerate(gaps)), f"the waits do not double: {gaps}"
    assert (outcome(4, 0.001), len(calls)) == ("gave up", 4)  # a 4th failure counts against the checkpoint
    # The restore path's reads retry with the default schedule: the first wait is 1 s.
    calls.clear()
    assert tiers._unreadable(lambda: flaky(1)) is None, "a transient error on the restore path was not retried"
    assert len(calls) == 2 and calls[1] - calls[0] >= 1.0, calls
    timeout = ValueError("DEADLINE_EXCEEDED: reading the OCDBT manifest")
    assert manifest.is_transient(timeout) and manifest.is_transient(TimeoutError())
    for permanent in (FileNotFoundError(errno.ENOENT, "gone"), ValueError("Unterminated string")):
        calls.clear()

        def broken(e=permanent):
            calls.append(1)
            raise e

        with pytest.raises(type(permanent)):
            manifest.retrying(broken, retries=3, wait_s=0.01)
        assert len(calls) == 1, permanent


# --- silent data corruption in training ---------------------------------------------------------------


@pytest.mark.slow
def test_a_bitflip_in_one_replica_is_caught_rewound_and_the_run_ends_identical(tmp_path, reference_run):
    """Checks every 7 steps and before every save (every 10): the flip before step 15 is caught by the check
    before the save of step 20 (the periodic one would come at 21), so the corrupt state is never saved, and
    the last check that passed was the periodic one of step 14."""
    ref = reference_run()  # the tiny config's mesh: data 2 x fsdp 2 x tensor 2; params are replicated over data
    run = tmp_path / "run"
    proc = run_trainer(run, "integrity.replica_check_steps=7", "faults=[{kind: bitflip, step: 15}]")
    # caught before the save of 20, not by the periodic check of 21; the last check passed: the periodic one of 14
    assert [(m["step"], m["last_good"]) for m in _of(run, E.REPLICA_MISMATCH)] == [(20, 14)]
    (mismatch,) = _of(run, E.REPLICA_MISMATCH)
    odd = [d for d in mismatch["devices"] if d["odd"]]
    assert {d["data"] for d in odd} == {0, 1} and len({(d["fsdp"], d["tensor"]) for d in odd}) == 1, mismatch
    assert "silent data corruption" in proc.stderr
    rewinds = [(e["to"], e["moved"]) for e in _of(run, E.REPLICA_REWIND)]
    assert rewinds == [(10, [])]  # every save was checked first: none is newer
    assert [e.get("exit_code") for e in _of(run, E.WORKER_EXIT)] == [exit_codes.REPLICA_MISMATCH, 0]
    assert [(e["step"], e["tier"]) for e in _of(run, E.RESTORE)] == [(10, "durable")]
    assert not (run / "faults_fired.json").read_text() == "[]"
    # The run ends identical: the final params, and every step's loss as the last attempt logged it (an
    # attempt that trained on a corrupt replica logged what it computed, before the check caught it).
    assert summary(run)["params_sha256"] == summary(ref)["params_sha256"]
    assert {k: v[-1] for k, v in step_losses(run).items()} == {k: v[0] for k, v in step_losses(ref).items()}


def test_the_replica_rewind_moves_checkpoints_newer_than_the_last_good_step_aside(tmp_path):
    """The supervisor's half, on its own: the end-to-end runs above never leave a checkpoint newer than
    `last_good` (every save is checked first), so what the rewind does with one is only seen here."""
    from test_tiers import restore, save, tiers

    from trainer.observe.events import EventLog
    from trainer.supervise import replica_rewind

    run = tmp_path / "run"
    t = tiers(run)
    for step in (10, 15, 20):
        save(t, step, DURABLE)
    t.close()
    log = EventLog(run / "events.jsonl")
    log.write(E.WORKER_START, pid=1)
    devices = [{"device": 0, "process": 0, "odd": False}, {"device": 1, "process": 0, "odd": True}]
    log.write(E.REPLICA_MISMATCH, step=22, last_good=12, param="w", devices=devices)
    log.close()
    written: list[dict] = []
    replica_rewind.rewind(run, lambda name, **f: written.append(dict(f, event=name)), tag=1, nodes=["n0"])
    (rewind,) = written
    assert (rewind["to"], rewind["moved"]) == (10, [15, 20]), "checkpoints newer than last_good were kept"
    assert checkpoint_files.committed_steps(run / "checkpoints") == [10]
    assert sorted(p.name for p in (run / checkpoint_files.REWOUND).iterdir()) == ["15-replica1", "20-replica1"]
    assert restore(tiers(run)) == (10, DURABLE, 10.0)  # the restart: the last checkpoint before the corruption


# --- the node-local tier ------------------------------------------------------------------------------


def _sealed_local(run: Path, local: Path) -> list[int]:
    d = checkpoint_files.local_root(str(local), run) / "process_0"
    return sorted(int(p.name) for p in d.glob("[0-9]*") if manifest.sealed(p)) if d.is_dir() else []


def _kill_after_local_save(run: Path, local: Path, overrides: list[str], step: int, durable: int) -> None:
    """Run unsupervised until the local checkpoint of `step` (and the durable one of `durable`, which may
    still be writing: the durable tier is the slower one) is sealed, then SIGKILL the worker at once."""
    with open(run.parent / f"{run.name}.log", "w") as log:
        proc = subprocess.Popen(
            trainer_cmd(run, *overrides, worker=True), cwd=ROOT, env=child_env(), stdout=log, stderr=log
        )
    deadline = time.time() + 300
    while step not in _sealed_local(run, local) or not manifest.sealed(run / "checkpoints" / str(durable)):
        assert proc.poll() is None and time.time() < deadline, (run.parent / f"{run.name}.log").read_text()[-3000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.mark.slow
def test_the_local_tier_resumes_at_the_local_save(tmp_path, reference_run):
    """(When the fast tier is lost with its node, the restart reads durable: tests/test_node_loss.py; when its
    copy is bad, the same: test_drill.py's corrupt test.)"""
    ref = reference_run()
    local = tmp_path / "local"
    # Local saves every 6 steps, durable every 10; steps 12-17 slowed so that step 12's local save is the
    # newest checkpoint when the kill lands (18's comes 6 s later).
    over = [
        f"checkpoint.local_dir={local}",
        "checkpoint.local_every_steps=6",
        "faults=[{kind: slow, step: 12, seconds: 1.0, count: 6}]",
    ]
    run = tmp_path / "kept"
    _kill_after_local_save(run, local, over, 12, 10)
    assert _sealed_local(run, local)[-1] == 12
    run_trainer(run, *over, worker=True)
    assert [(e["step"], e["tier"]) for e in _of(run, E.RESTORE)] == [(12, "local")]
    assert not _of(run, E.CHECKPOINT_REJECTED)
    _same_as(run, ref, unlogged=(12,))
    assert {e["tier"] for e in _of(run, E.CHECKPOINT_SAVED)} == {"local", "durable"}


# --- storage faults -----------------------------------------------------------------------------------


@pytest.fixture
def tmpfs(tmp_path):
    """A 32 MB tmpfs: a disk that fills up for real."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    out = subprocess.run(
        [*sudo, "mount", "-t", "tmpfs", "-o", "size=32M", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if out.returncode:
        why = f"cannot mount a tmpfs to fill up ({out.stderr.strip()}): needs root or passwordless sudo"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    yield mnt
    subprocess.run([*sudo, "umount", "-l", str(mnt)], check=True)


def _fill(mnt: Path, leave_mb: float) -> Path:
    st = os.statvfs(mnt)
    filler = mnt / "filler"
    with open(filler, "wb") as fh:
        fh.write(b"\0" * int(st.f_bavail * st.f_frsize - leave_mb * 2**20))
    return filler


def test_events_and_tensorboard_survive_a_full_disk(tmpfs, capfd):
    from trainer.observe.events import EventLog
    from trainer.observe.tensorboard import Writer

    log, tb = EventLog(tmpfs / "events.jsonl"), Writer(tmpfs / "tb")
    filler = _fill(tmpfs, 0)
    for i in range(200):  # neither raises nor blocks (tensorboardX's queue would stall once its thread died)
        log.write(E.STEP, step=i, loss=1.0, pad="x" * 100)
        tb.add(i, {"loss/train": 1.0})
    tb._w.flush()
    filler.unlink()
    log.write(E.STEP, step=999, loss=2.0)
    tb.add(999, {"loss/train": 2.0})
    tb.close()
    log.close()
    err = capfd.readouterr().err
    assert err.count("no space left on the device") == 2, err  # one warning each, not one per write
    lines = (tmpfs / "events.jsonl").read_text().splitlines()
    assert all(json.loads(x) for x in lines) and json.loads(lines[-1])["step"] == 999  # whole lines only


def test_a_local_save_that_fails_turns_the_local_tier_off_and_the_durable_tier_goes_on(tmp_path, tmpfs):
    """A full RAM disk under checkpoint.local_dir: one checkpoint_failed (tier local), no more local saves in
    this attempt, durable saves and the run go on; the next attempt (a restart) uses the local tier again."""
    from test_tiers import restore, save, tiers

    run, local, log = tmp_path / "run", tmpfs / "local", []
    t = tiers(run, local, log=log)
    filler = _fill(tmpfs, 0.5)
    save(t, 2, LOCAL, size=1 << 18)  # 1 MB: fails in Orbax's background write
    for _ in range(3000):  # the loop asks every step; the failure surfaces once the background write failed
        assert t.failure() is None, "a local failure stops the run"  # only a durable failure does
        t.drop_failed_local()
        if log:
            break
        time.sleep(0.01)
    save(t, 4, LOCAL)
    save(t, 4, DURABLE)
    save(t, 6, LOCAL)
    assert t.failure() is None
    t.drop_failed_local()
    failed = [(e["tier"], "the disk is full" in e["message"]) for e in log if e["event"] == E.CHECKPOINT_FAILED]
    assert failed == [(LOCAL, True)], log  # once: the tier is off, later local saves are not even tried
    t.close()
    assert checkpoint_files.committed_steps(checkpoint_files.local_dir(str(local), run, 0, t.node)) == []
    assert restore(tiers(run, local)) == (4, DURABLE, 4.0)
    filler.unlink()
    t = tiers(run, local, log=log)  # the next attempt
    save(t, 8, LOCAL)
    t.close()
    assert restore(tiers(run, local)) == (8, LOCAL, 8.5), "the local tier stayed off after a restart"


HEARTBEAT_ON_A_FULL_DISK = """
import json, sys, time
from pathlib import Path
from trainer.config import Phase
from trainer.observe import heartbeat
run, filler = Path(sys.argv[1]), Path(sys.argv[2])
hb = heartbeat.Heartbeat(run, 0)
hb.beat(Phase.STEP, 1)
with open(filler, "wb", buffering=0) as fh:  # fill the disk to its last page (a short write, then ENOSPC)
    try:
        while fh.write(bytes(1 << 20)):
            pass
    except OSError:
        pass
hb.beat(Phase.STEP, 2)  # dropped: the last beat stays
time.sleep(heartbeat.PULSE_S * 1.5)  # the pulse thread meets the full disk too
full = heartbeat.read(heartbeat.heartbeat_path(run, 0)).step
filler.unlink()
hb.beat(Phase.STEP, 3)
t0 = time.time()
while (heartbeat.read_json(heartbeat.pulse_path(run, 0)) or {}).get("time", 0) < t0 and time.time() < t0 + 10:
    time.sleep(0.05)
pulse = heartbeat.read_json(heartbeat.pulse_path(run, 0))["time"] >= t0
print(json.dumps([full, heartbeat.read(heartbeat.heartbeat_path(run, 0)).step, pulse]))
"""


def test_heartbeats_and_pulses_survive_a_full_disk(tmpfs):
    """In a process of its own (the pulse thread outlives any test): on a full disk a beat is dropped and the
    last one stays, the pulse thread lives on; both write again once there is space."""
    out = subprocess.run(
        [sys.executable, "-c", HEARTBEAT_ON_A_FULL_DISK, str(tmpfs / "run"), str(tmpfs / "filler")],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout) == [1, 3, True], out.stderr[-3000:]


@pytest.mark.slow
def test_a_full_disk_is_waited_out_and_the_run_resumes_on_its_own(tmpfs, reference_run):
    """The disk fills in a save: the supervisor does not restart into it (a restart would fail again at its next
    save) but waits for room for one more checkpoint, saying so; once there is room (here the test frees it),
    it restarts from the newest sealed checkpoint by itself and the run ends as the undisturbed one."""
    ref = reference_run()
    run, log = tmpfs / "run", tmpfs.parent / "run.log"
    filler = _fill(tmpfs, 5)  # a micro checkpoint is ~1.8 MB: two fit, the third fills the disk mid-write
    cmd = trainer_cmd(run, "checkpoint.every_steps=5", "supervisor.storage_wait_minutes=5")
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=fh, stderr=subprocess.STDOUT)
    deadline = time.time() + 240
    while "waiting up to 5 min for room" not in log.read_text() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    text = log.read_text()
    assert proc.poll() is None and "the checkpoint disk is full" in text, text[-3000:]
    assert "the disk is full" in text  # the worker's message: which checkpoint, where, what to do
    failed = [(e["tier"], "the disk is full" in e["message"]) for e in _of(run, E.CHECKPOINT_FAILED)]
    assert failed == [("durable", True)], "no checkpoint_failed event"
    kept = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    # The disk may fill inside Orbax's write (no step dir appears) or after its commit, while the manifest is
    # written (the step dir stays, unsealed: never restored). Either way every sealed checkpoint is intact, and
    # an unsealed one can only be the save the full disk interrupted.
    good = [s for s in kept if manifest.sealed(run / "checkpoints" / str(s))]
    assert good and all(manifest.verify(run / "checkpoints" / str(s)) is None for s in good), kept
    assert set(kept) - set(good) <= {s for s in kept if s > good[-1]}, (kept, good)
    time.sleep(2.5)  # still waiting (a poll or more later): no restart into the full disk
    assert not _of(run, E.RESTART) and proc.poll() is None
    filler.unlink()
    assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    [cleared] = [e for e in _of(run, E.ALERT_CLEARED) if e["kind"] == "disk_full"]
    assert cleared["waited_s"] >= 2.5 and [e["reason"] for e in _of(run, E.RESTART)] == ["disk full"]
    assert [e["step"] for e in _of(run, E.RESTORE)][-1] == good[-1]
    assert sorted(e["step"] for e in _of(run, E.CHECKPOINT_REJECTED)) == sorted(set(kept) - set(good))
    _same_as(run, ref)


def test_no_room_within_the_wait_stops_the_run_for_a_human(tmpfs):
    """The supervisor's wait on its own: no room in supervisor.storage_wait_minutes, it gives up (the run stops
    with exit 81 and the worker's message); room within it, it goes on; a preemption ends the wait."""
    from trainer.supervise import storage

    run = tmpfs / "run"
    run.mkdir()
    filler, written = _fill(tmpfs, 0.5), []  # no checkpoint yet: one needs storage.MIN_ROOM (1 MiB)
    t0 = time.monotonic()
    assert not storage.wait_for_room(run, 0.05, lambda *a, **k: written.append((a, k)), step=5, stop=lambda: False)
    assert time.monotonic() - t0 >= 3 and written[0][1]["kind"] == "disk_full", written  # 0.05 min waited
    t0 = time.monotonic()
    assert not storage.wait_for_room(run, 5, lambda *a, **k: None, step=5, stop=lambda: True)
    assert time.monotonic() - t0 < 10
    assert not storage.wait_for_room(run, 0, lambda *a, **k: None, step=5, stop=lambda: False)  # 0: never wait
    import threading

    threading.Timer(1.0, filler.unlink).start()
    assert storage.wait_for_room(run, 1, lambda *a, **k: written.append((a, k)), step=5, stop=lambda: False)
    assert written[-1][0][0] == E.ALERT_CLEARED and written[-1][1]["free_bytes"] >= storage.MIN_ROOM


# --- several processes: every process verifies its share, all agree before anything moves -----------------


@pytest.mark.slow
def test_two_processes_on_a_disk_that_stays_full_stop_with_exit_81_and_its_line(tmpfs, tmp_path):
    """The disk fills in a save of a 2-process run and no room comes in supervisor.storage_wait_minutes: the run
    stops for a human with exit 81 (no restart into the full disk), the worker's message and the supervisor's
    line saying what happened and what to do; every sealed checkpoint stays intact."""
    from multihost import TWO, group_overrides, small_corpus

    run, log = tmpfs / "run", tmp_path / "run.log"
    _fill(tmpfs, 5)  # two micro checkpoints fit, the third fills the disk mid-write; nothing frees it
    overrides = group_overrides(
        small_corpus(tmp_path / "corpus"), *TWO, "checkpoint.every_steps=5", "supervisor.storage_wait_minutes=0.05"
    )
    with open(log, "w") as fh:
        code = subprocess.run(trainer_cmd(run, *overrides), cwd=ROOT, env=child_env(), stdout=fh, stderr=fh).returncode
    text = log.read_text()
    assert code == exit_codes.STORAGE, text[-3000:]
    assert "the disk is full" in text and "giving up (checkpoint storage failed)" in text, text[-3000:]
    assert "no room for one more came in supervisor.storage_wait_minutes (0.05)" in text, text[-3000:]
    # No restart into the full disk. Said by the supervisor's output, not its events: on a disk that stays full
    # an event written after it filled is dropped (events never raise), unless the failed save's files happened
    # to be removed first (seen: 4 of 6 runs under load had none of the supervisor's last events).
    assert "restarting in" not in text, text[-3000:]
    good = [d for d in (run / "checkpoints").iterdir() if d.name.isdigit() and manifest.sealed(d)]
    assert good and all(manifest.verify(d) is None for d in good), good


@pytest.mark.slow
def test_a_step_is_assembled_from_any_copy_a_node_holds_never_from_a_partial_one(tmp_path_factory):
    """Two processes standing for two nodes (TRAINER_NODE_NAME; each its own local folder through {node}):
    every local save also leaves each process's shards with the other. Then, before the restart:
    - durable step 20 has a bad shard that only process 1 reads: both processes agree to pass it over;
    - process 1's folder turns up on node fake0 (as when a restart maps process indices to nodes anew) and
      fake1 is empty;
    - both copies of process 1's shards at local step 16 are corrupt: 16 cannot be assembled (each bad copy
      is rejected alone, and the plan is made again after each);
    - process 1's own copy of step 12 is gone: 12 is assembled from the copy process 0 holds for it.
    So the restore takes 12, process 1's shards read on fake0 and moved over the collectives, and the folder
    no process on fake0 writes any more is dropped once a new local save is sealed."""
    from multihost import TWO, group_overrides, reference

    ref, corpus = reference(tmp_path_factory)
    run, local = tmp_path_factory.mktemp("buddy") / "run", tmp_path_factory.mktemp("local")
    over = group_overrides(corpus, *TWO, f"checkpoint.local_dir={local}/{{node}}", "checkpoint.local_every_steps=4")
    nodes = {"TRAINER_NODE_NAME": "fake{process}"}
    run_trainer(run, *over, "train.stop_at_step=20", env=nodes)  # durable 10, 20; local 8, 12, 16 (keep 3)
    roots = [checkpoint_files.local_root(f"{local}/{{node}}", run, f"fake{i}") for i in (0, 1)]
    assert [sorted(int(p.name) for p in (r / f"process_{i}").glob("[0-9]*")) for i, r in enumerate(roots)] == [
        [8, 12, 16],
        [8, 12, 16],
    ]
    assert all((r / f"process_{i}" / "16" / "buddy").is_dir() for i, r in enumerate(roots))
    shard = corrupt.largest_file(run / "checkpoints" / "20" / "state" / "ocdbt.process_1")  # only process 1 reads it
    shard.write_bytes(shard.read_bytes()[:-64] + bytes(64))
    shutil.move(roots[1] / "process_1", roots[0] / "process_1")
    bad = {corrupt.flip(roots[0] / "process_1" / "16"), corrupt.flip(roots[0] / "process_0" / "16", "buddy")}
    shutil.rmtree(roots[0] / "process_1" / "12")
    run_trainer(run, *over, env=nodes)
    rejected = _of(run, E.CHECKPOINT_REJECTED)
    assert [(e["step"], e["tier"], e["process"]) for e in rejected] == [
        (20, "durable", 1),
        (16, "local", 0),
        (16, "local", 0),
    ], rejected
    assert "ocdbt.process_1" in rejected[0]["file"], rejected[0]
    assert {e["file"].split("/", 1)[0] for e in rejected[1:]} == {"process_0", "process_1"}, (rejected, bad)
    (restore,) = _of(run, E.RESTORE)
    assert (restore["step"], restore["tier"]) == (12, "local"), restore
    assert restore["sources"] == {
        "0": {"process": 0, "node": "fake0", "copy": "state"},
        "1": {"process": 0, "node": "fake0", "copy": "buddy"},
    }, restore
    assert summary(run)["params_sha256"] == summary(ref)["params_sha256"]
    losses, ref_losses = step_losses(run), step_losses(ref)
    assert all(set(v) == {ref_losses[k][0]} for k, v in losses.items())
    assert sorted(p.name for p in roots[0].glob("process_*")) == ["process_0"]


# --- kills inside async saves ---------------------------------------------------------------------------


def _hb(run: Path) -> dict | None:
    try:
        return json.loads((run / "heartbeat" / "worker-0.json").read_text())
    except (OSError, ValueError):
        return None


def _stepped(run: Path) -> bool:
    """Whether the latest attempt logged a step."""
    evs = events(run)
    start = max((i for i, e in enumerate(evs) if e["event"] == E.WORKER_START), default=None)
    return start is not None and any(e["event"] == E.STEP for e in evs[start:])


def _exit_of(run: Path, pid: int, sup: subprocess.Popen) -> dict:
    """The supervisor's worker_exit event for the worker with this pid (once it wrote it)."""
    deadline = time.time() + 60
    while time.time() < deadline and sup.poll() is None:
        if ex := next((e for e in events(run) if e["event"] == E.WORKER_EXIT and e.get("pid") == pid), None):
            return ex
        time.sleep(0.05)
    return {}


# 12 kills over 50 steps: the same kinds of kill as the first version's 22 over 80, at about half its CPU
# (every attempt is a process start, a restore and a compile-cache load).
STEPS, SAVE_KILLS = 50, 9


@pytest.mark.slow
def test_kills_at_random_moments_and_inside_async_saves_never_break_a_restore(tmp_path, reference_run):
    """2 crash_mid_save faults plus 9 SIGKILLs from outside, each a random 0-300 ms after the worker enters
    a save (device-to-host copy, background write, commit or sealing), at a new step each time, and 1 more
    in the middle of a step at random. Both tiers: durable every 5 steps, local every 2, so saves are
    durable-only (5, 15, ...), local-only (2, 4, ...) or both (10, 20, ...), and a restart may restore from
    either tier. Every attempt restores; the run ends bitwise the uninterrupted one, and the goodput ledger
    accounts for the restarts and the recomputed steps."""
    ref = reference_run(f"train.steps={STEPS}")
    run = tmp_path / "run"
    over = [
        f"train.steps={STEPS}",
        "supervisor.max_restarts=20",
        "faults=[{kind: crash_mid_save, step: 9}, {kind: crash_mid_save, step: 33}]",
        "checkpoint.every_steps=5",
        f"checkpoint.local_dir={tmp_path / 'local'}",
        "checkpoint.local_every_steps=2",
    ]
    rng = __import__("random").Random(14)
    in_step = [rng.randint(3, 7)]  # kill once past this step, mid-step
    with open(tmp_path / "supervisor.log", "w") as log:
        sup = subprocess.Popen(trainer_cmd(run, *over), cwd=ROOT, env=child_env(), stdout=log, stderr=log)
    kills, missed, last = {"save": 0, "step": 0}, 0, 0
    while sum(kills.values()) < SAVE_KILLS + 1 and sup.poll() is None:
        hb = _hb(run)
        # (a kill only once this attempt logged a step: a kill before its first step would end the recovery
        # the ledger is measuring, which it then rightly never records. CI saw it: an attempt that restored
        # durable step 15 killed in the save of 16, before it logged step 16. The crash_mid_save faults, at
        # 9 and 33, fire in the saves of 10 and 34, never right after a restore: no checkpoint is at 9 or 33.
        # Those two saves are theirs: a SIGKILL landing between a fault's record and its exit took its crash
        # in a profile run of the suite, which then never fired again. So is the local save before each: a
        # kill decided there waits up to 0.3 s, two ~0.1 s steps, and a fresh-clone run saw one decided in the
        # save of 8 land in the crash of 10)
        kind = None
        # Every kill at a step past the last one's: three failures at one step are a crash loop, and the
        # supervisor rightly gives up (a fresh-clone run saw it: the mid-step kill at 4 before the local save of 2
        # was sealed, the fresh start killed in the save of 4, and the resume from 2 killed at 4 again)
        if hb and hb["phase"] == "step" and in_step and hb["step"] >= in_step[0] and hb["step"] > last:
            kind = "step"
        elif (
            hb
            and hb["phase"] == "checkpoint"
            and last < hb["step"] < STEPS - 2
            and not (8 <= hb["step"] <= 10 or 32 <= hb["step"] <= 34)  # the faults' saves, and a delay short of them
            and kills["save"] < SAVE_KILLS
        ):
            kind = "save"
        if kind is None or not _stepped(run):
            time.sleep(0.01)
            continue
        last = hb["step"]
        if kind == "step":
            due = in_step.pop(0)
            time.sleep(rng.uniform(0, 0.05))
        else:
            time.sleep(rng.uniform(0, 0.3))
        # A kill counts once it killed: the worker may have left by itself meanwhile (a crash_mid_save
        # fault firing in that very save, or an earlier kill the heartbeat does not show yet), and then the
        # next one gets the kill.
        try:
            os.kill(hb["pid"], signal.SIGKILL)
            killed = _exit_of(run, hb["pid"], sup).get("signal") == "SIGKILL"
        except ProcessLookupError:
            killed = False
        kills[kind] += killed
        missed += not killed
        if kind == "step" and not killed:
            in_step.insert(0, due)
    assert sup.wait(timeout=1200) == 0, (tmp_path / "supervisor.log").read_text()[-3000:]
    evs = events(run)
    exits = [e for e in evs if e["event"] == E.WORKER_EXIT]
    crashes = sum(e.get("exit_code") == 13 for e in exits)
    assert kills == {"save": SAVE_KILLS, "step": 1} and crashes == 2, (kills, missed, exits)
    assert sum(e.get("signal") == "SIGKILL" for e in exits) == SAVE_KILLS + 1, exits
    starts = [e for e in evs if e["event"] in (E.RESTORE, E.INIT)]
    assert len(starts) == len(exits) == SAVE_KILLS + 4  # every attempt got past its restore
    rejected = [e for e in evs if e["event"] == E.CHECKPOINT_REJECTED]
    broken = [e for e in rejected if not e["reason"].startswith("unverified")]  # a kill may only cut a seal short
    assert not broken, broken
    s = summary(run)
    assert s["restarts"] == SAVE_KILLS + 3 and len(s["recoveries_s"]) == SAVE_KILLS + 3, s
    assert abs(sum(s["goodput"]["fractions"].values()) - 1) < 1e-9
    assert s["goodput"]["seconds"]["recompute"] > 0 and s["goodput"]["seconds"]["restart"] > 0, s["goodput"]
    _same_as(run, ref, unlogged=tuple(e["step"] for e in starts))
    tally = {t: sum(e.get("tier") == t for e in starts) for t in ("local", "durable")}
    print(
        f"{SAVE_KILLS + 3} kills ({kills} SIGKILL + {crashes} crash_mid_save), restores {tally}, "
        f"init {sum(e['event'] == E.INIT for e in starts)}, unsealed checkpoints set aside {len(rejected)}, "
        f"broken restores {len(broken)}, final params_sha256 {summary(run)['params_sha256'][:16]} == reference"
    )


def test_a_step_deleted_while_its_seals_are_listed_is_unsealed_not_a_crash(tmp_path, monkeypatch):
    """Retention may delete an old step while a save lists which steps are sealed: the listing of its manifest
    folder then fails midway (the folder went between the check and the scan). Seen in a fresh-clone CI run: a
    worker died of that FileNotFoundError in a local save. Such a step is simply not sealed."""
    step = tmp_path / "local" / "2"
    (step / manifest.DIR).mkdir(parents=True)
    assert checkpoint_files.sealed_steps(tmp_path / "local") == []  # no manifest yet: unsealed, as before

    def vanished(self, pattern):  # what os.scandir raises when the folder goes while it is opened
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(self))
        yield  # a generator, as Path.glob is

    monkeypatch.setattr(Path, "glob", vanished)
    try:
        listed = checkpoint_files.sealed_steps(tmp_path / "local")
    except OSError as e:  # the bug: the save that asked dies of it
        listed = e
    assert listed == [], f"a step that went is no sealed step, not {listed!r}"
