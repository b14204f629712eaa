"""Goodput ledger: where the wall-clock time of a run went, computed from its events.jsonl.

Categories: productive steps, recomputed steps (work redone after a rollback), checkpoint blocking,
initial startup, and restart downtime (detection, backoff, process start, restore, compile, and
work lost in the step that was running when a worker died). No jax here: the supervisor uses it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

CATEGORIES = ("productive", "recompute", "checkpoint", "startup", "restart")


def iter_events(path: Path, skipped: list[str] | None = None) -> Iterator[dict]:
    """events.jsonl oldest first, streamed (a long run logs millions of steps); unreadable lines (one torn
    by a kill mid-write) are left out, and appended to `skipped` when given."""
    if not Path(path).is_file():
        return
    with open(path, errors="replace") as fh:
        for line in fh:
            try:
                yield json.loads(line)
            except ValueError:
                if skipped is not None and line.strip():
                    skipped.append(line)


def read_events(path: Path) -> list[dict]:
    return list(iter_events(path))


def _lines_backwards(path: Path, block: int = 1 << 16) -> Iterator[bytes]:
    """Lines of a file from the last to the first, reading only as much as the caller consumes."""
    with open(path, "rb") as fh:
        pos = fh.seek(0, os.SEEK_END)
        rest = b""
        while pos > 0:
            n = min(block, pos)
            pos -= n
            fh.seek(pos)
            lines = (fh.read(n) + rest).split(b"\n")
            rest = lines[0]
            yield from (line for line in reversed(lines[1:]) if line)
        if rest:
            yield rest


def events_newest_first(path: Path) -> Iterator[dict]:
    """events.jsonl from the end: readers that need only the recent past never parse a long history."""
    if not Path(path).is_file():
        return
    for line in _lines_backwards(Path(path)):
        try:
            yield json.loads(line)
        except ValueError:  # a line torn by a kill mid-write
            continue


def _sessions(events: list[dict], t_end: float) -> list[tuple[float, float, list[dict]]]:
    """Split the history at each supervisor start; time between sessions (queued job) is not ours."""
    sessions, cur = [], None
    for e in events:
        if e["event"] == "supervisor_start":
            if cur:
                sessions.append(cur)
            cur = [e["time"], e["time"], []]
        elif cur is not None:
            cur[1] = e["time"]
            cur[2].append(e)
    if cur:
        sessions.append(cur)
    return [tuple(s) for s in sessions]


def ledger(events: list[dict], t_start: float, t_end: float) -> dict:
    secs = dict.fromkeys(CATEGORIES, 0.0)
    best = 0
    recoveries, wall = [], 0.0
    sessions = _sessions(events, t_end)
    for i, (s0, s1, evs) in enumerate(sessions):
        if i == len(sessions) - 1:
            s1 = max(s1, t_end)
        wall += s1 - s0
        first_step_t, fail_t, last_step_t = None, None, None
        for e in evs:
            kind = e["event"]
            if kind in ("run_complete", "stopped", "preempted") and last_step_t is not None and "by" not in e:
                secs["checkpoint"] += e["time"] - last_step_t  # waiting for the final save to be durable
                last_step_t = None
            if kind == "step":
                last_step_t = e["time"]
                block = e.get("ckpt_block_s", 0.0)
                secs["checkpoint"] += block
                secs["recompute" if e["step"] <= best else "productive"] += max(e["step_s"] - block, 0.0)
                best = max(best, e["step"])
                if first_step_t is None:
                    first_step_t = e["time"] - e["step_s"]
                if fail_t is not None:
                    recoveries.append(e["time"] - fail_t)
                    fail_t = None
            elif kind == "worker_exit" and e.get("exit_code", 1) not in (0, 75):
                fail_t = e["time"]
            elif kind == "hang_detected":
                fail_t = e["time"]
        if first_step_t is not None and i == 0:
            secs["startup"] += first_step_t - s0
    accounted = sum(v for k, v in secs.items() if k != "restart")
    secs["restart"] = max(wall - accounted, 0.0)
    total = sum(secs.values()) or 1.0
    return {
        "goodput": {"fractions": {k: v / total for k, v in secs.items()}, "seconds": secs},
        "recoveries_s": recoveries,
        "wall_s": wall,
    }


def to_tensorboard(logdir: Path, led: dict, restarts: int, step: int) -> None:
    from tensorboardX import SummaryWriter

    # Its own file suffix: two writers opened in the same second would otherwise share a file name.
    w = SummaryWriter(str(logdir), filename_suffix=f".goodput{int(time.time() * 1e6)}")
    for k, v in led["goodput"]["fractions"].items():
        w.add_scalar(f"goodput/{k}_fraction", v, step)
    for k, v in led["goodput"]["seconds"].items():
        w.add_scalar(f"goodput/{k}_s", v, step)
    w.add_scalar("goodput/restarts", restarts, step)
    w.close()
