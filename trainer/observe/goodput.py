"""Goodput ledger: where the wall-clock time of a run went, computed from its events.jsonl.

Categories: productive steps, recomputed steps (work redone after a rollback), straggler (the part of the
steps a slow process cost the group, from the supervisor's verdicts, and a drain's restart without it),
checkpoint blocking, initial startup, shutdown (a worker's clean exit: from its last event to the end of the
session), and restart downtime (detection, backoff, process start, restore, compile, and work lost in the step that
was running when a worker died; a resumed session's start counts here too). Beside it, `downtime_s`: each
restart's own account of it, from the failure (trainer.observe.downtime). No jax here: the
supervisor uses it.
"""

from __future__ import annotations

import time
from pathlib import Path

from trainer.observe.tensorboard import Writer
from trainer.store.event_names import (
    DOWNTIME,
    HANG_DETECTED,
    RESTART,
    SESSION_STARTS,
    STEP,
    STRAGGLER,
    STRAGGLER_CLEARED,
    STRAGGLER_DRAINED,
    WORKER_CLEAN_END,
    WORKER_EXIT,
    WORKER_START,
)

CATEGORIES = ("productive", "recompute", "straggler", "checkpoint", "startup", "shutdown", "restart")


def _sessions(events: list[dict], t_end: float) -> list[tuple[float, float, list[dict]]]:
    """Split the history at each supervisor start; time between sessions (queued job) is not ours. By time,
    not file order: the supervisor holds its first events back until a worker accepted the config, so they
    land in the file after the worker's first events."""
    sessions, cur = [], None
    for e in sorted(events, key=lambda e: e["time"]):
        if e["event"] in SESSION_STARTS:
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
    slowed = 0.0  # step seconds a straggler cost the group: moved from productive to straggler at the end
    sessions = _sessions(events, t_end)
    for i, (s0, s1, evs) in enumerate(sessions):
        if i == len(sessions) - 1:
            s1 = max(s1, t_end)
        wall += s1 - s0
        first_step_t, fail_t, last_step_t, clean_end_t, drained_t = None, None, None, None, None
        for e in evs:
            kind = e["event"]
            if kind in WORKER_CLEAN_END and "by" not in e:
                if last_step_t is not None:
                    secs["checkpoint"] += e["time"] - last_step_t  # waiting for the final save to be durable
                    last_step_t = None
                clean_end_t = e["time"]
            elif kind in (WORKER_START, RESTART):
                clean_end_t = None
            if kind == STEP:
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
                if drained_t is not None:  # a drain's cost: from its group's exit to the first step without it
                    secs["straggler"] += max(e["time"] - e["step_s"] - drained_t, 0.0)
                    drained_t = None
            elif kind in (STRAGGLER, STRAGGLER_CLEARED):
                slowed += e.get("lost_s", 0.0)
            elif kind == STRAGGLER_DRAINED:
                drained_t = e["time"]
            elif kind == WORKER_EXIT and e.get("exit_code", 1) not in (0, 75):
                fail_t = e["time"]
            elif kind == HANG_DETECTED:
                fail_t = e["time"]
        if first_step_t is not None and i == 0:
            secs["startup"] += first_step_t - s0
        if clean_end_t is not None:  # the worker exiting (interpreter and runtime teardown), the final ledger
            secs["shutdown"] += s1 - clean_end_t
    moved = min(slowed, secs["productive"])
    secs["productive"] -= moved
    secs["straggler"] += moved
    accounted = sum(v for k, v in secs.items() if k != "restart")
    secs["restart"] = max(wall - accounted, 0.0)
    total = sum(secs.values()) or 1.0
    return {
        "goodput": {"fractions": {k: v / total for k, v in secs.items()}, "seconds": secs},
        "recoveries_s": recoveries,
        # each restart's own account, failure to first step, detection included (trainer.observe.downtime)
        "downtime_s": [e["total_s"] for e in events if e["event"] == DOWNTIME],
        "wall_s": wall,
    }


def to_tensorboard(logdir: Path, led: dict, restarts: int, step: int) -> None:
    w = Writer(logdir, suffix=f".goodput{int(time.time() * 1e6)}")
    w.add(step, {f"goodput/{k}_fraction": v for k, v in led["goodput"]["fractions"].items()})
    w.add(step, {f"goodput/{k}_s": v for k, v in led["goodput"]["seconds"].items()})
    w.add(step, {"goodput/restarts": restarts})
    w.close()
