"""A checkpoint that could not be written for want of space (worker exit STORAGE): wait for room, then restart.

A restart into a disk that is still full would only fail again at the next save; stopping hands the job to
a human, which at night means hours of an idle allocation, or a job that left the queue. So the supervisor
waits, for at most `supervisor.storage_wait_minutes`, until the checkpoint directory's filesystem has room
for one more checkpoint (the newest one's size: retention deletes the oldest only after a new one is
written), with an alert while it waits; then it restarts from the newest checkpoint. No room in that time
(e.g. the run's own checkpoints fill a disk too small for checkpoint.keep_latest + 1 of them): it stops
with the worker's message, exit STORAGE, as before. Never imports jax.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from trainer.observe.alerts import ALERTS, Kind
from trainer.store import ckpt_files as checkpoint_files
from trainer.store.event_names import ALERT, ALERT_CLEARED

POLL_S = 2.0
MIN_ROOM = 1 << 20  # before the first checkpoint there is no size to go by


def room_needed(run_dir: Path) -> int:
    """Bytes one more checkpoint takes: the newest committed durable checkpoint's."""
    durable = checkpoint_files.durable_dir(run_dir)
    steps = checkpoint_files.committed_steps(durable)
    if not steps:
        return MIN_ROOM
    files = (p for p in (durable / str(steps[-1])).rglob("*") if p.is_file())
    return max(sum(p.stat().st_size for p in files), MIN_ROOM)


def free_bytes(run_dir: Path) -> int:
    """Free bytes on the filesystem of the durable checkpoints (the run dir's, before the first save)."""
    path = checkpoint_files.durable_dir(run_dir)
    return shutil.disk_usage(path if path.is_dir() else run_dir).free


def wait_for_room(
    run_dir: Path, minutes: float, write: Callable[..., None], *, step: int | None, stop: Callable[[], bool]
) -> bool:
    """True once one more checkpoint fits (at once if it already does: the space was freed, or the error was
    passing); False when `minutes` pass without room, or `stop()` (the job is being preempted). With the durable
    tier in a bucket: once the bucket answers again."""
    if (url := checkpoint_files.durable_url(run_dir)) and not _wait_for_bucket(
        url, minutes, write, step=step, stop=stop
    ):
        return False
    need, have = room_needed(run_dir), free_bytes(run_dir)
    if have >= need or minutes <= 0:
        return have >= need
    detail = (
        f"the checkpoint disk is full ({have / 2**20:.1f} MiB free, a checkpoint takes {need / 2**20:.1f} MiB): "
        f"waiting up to {minutes:g} min for room, then restarting from the newest checkpoint"
    )
    meaning, action = ALERTS[Kind.DISK_FULL]
    write(
        ALERT,
        step=step,
        kind=Kind.DISK_FULL,
        detail=detail,
        free_bytes=have,
        need_bytes=need,
        meaning=meaning,
        runbook=action,
    )
    print(f"supervisor: {detail}", file=sys.stderr, flush=True)
    deadline, t0 = time.monotonic() + minutes * 60, time.monotonic()
    while time.monotonic() < deadline and not stop():
        time.sleep(POLL_S)
        if (have := free_bytes(run_dir)) >= need:
            write(ALERT_CLEARED, step=step, kind=Kind.DISK_FULL, free_bytes=have, waited_s=time.monotonic() - t0)
            return True
    return False


def _wait_for_bucket(
    url: str, minutes: float, write: Callable[..., None], *, step: int | None, stop: Callable[[], bool]
) -> bool:
    """The bucket did not answer a save or a restore: wait until it lists again (an outage, an endpoint
    restarted), with an alert. Then the staging directory's room is checked as for a path."""
    from trainer.store import bucket

    b = bucket.Bucket(url)
    if (why := b.check()) is None or minutes <= 0:
        return why is None
    meaning, action = ALERTS[Kind.BUCKET_DOWN]
    write(ALERT, step=step, kind=Kind.BUCKET_DOWN, detail=why, meaning=meaning, runbook=action)
    print(f"supervisor: {why}: waiting up to {minutes:g} min for it, then restarting", file=sys.stderr, flush=True)
    deadline, t0 = time.monotonic() + minutes * 60, time.monotonic()
    while time.monotonic() < deadline and not stop():
        time.sleep(POLL_S)
        if b.check() is None:
            write(ALERT_CLEARED, step=step, kind=Kind.BUCKET_DOWN, waited_s=time.monotonic() - t0)
            return True
    return False
