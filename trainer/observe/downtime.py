"""What each failure cost the group, in seconds, part by part: from the failure to the first step trained again.

The supervisor knows the first half (when the failure happened, when it knew, when the old processes were gone,
when it launched the next attempt) and hands it to the next attempt in TRAINER_FAILURE; the next attempt's
process 0 knows the rest (when its process started, its restore, its compile, its first step) and writes one
`downtime` event at its first step. `status`, the report, the goodput ledger, the survival model and the drill
read that event. No jax here.

The failure's moment is an estimate where nobody saw it happen: a process that died or froze is known alive
at its last pulse (every heartbeat.PULSE_S), so it failed within PULSE_S after it; the midpoint is taken
(+- half a pulse). A process that exited was seen exiting by the supervisor within a poll; a hang failed at its last
heartbeat.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Sequence

from trainer.observe.heartbeat import Pulse, after_last_pulse
from trainer.store import env_vars
from trainer.store.event_names import DOWNTIME

# The boundaries, in order, and the part that ends at each.
MARKS = ("failed", "noticed", "down", "launched", "started", "restoring", "restored", "ready", "stepped")
PARTS = {
    "noticed": "the failure until the supervisor knew (pulses, exits, srun's reports, hang timeouts)",
    "teardown": "until every process of the failed group was gone",
    "relaunch": "until the next group was launched (backoff, the runbook, node planning)",
    "launch": "until the new processes ran (srun's step, the interpreter)",
    "init": "imports, jax.distributed, data, mesh and state spec, until the restore began",
    "restore": "reading the checkpoint",
    "compile": "the data iterator, compiling the step (a cache hit) and eval",
    "first_step": "the first step, with the time every process takes to join its first collectives",
}


def failed_at(pulses: Sequence[Pulse | None], cause_t: float, noticed: float) -> float:
    """When a group failed that ended by itself: when the first process that failed by itself was seen leaving
    (`cause_t`, within a poll); where none was (a lost node's process is never reported, only its survivors'
    reactions), within a pulse of the oldest pulse that stopped, not leaving on purpose; else when noticed."""
    if cause_t:
        return min(cause_t, noticed)
    stopped = [p for p in pulses if p and not p.ending]
    return min(after_last_pulse(min(stopped, key=lambda p: p.time)), noticed) if stopped else noticed


def for_next_attempt(failure: dict, launched: float) -> str:
    """TRAINER_FAILURE for the next attempt's processes: `failure` has since (the outage's first failure: an
    attempt that failed before its first step prolongs it), failed, noticed, down and reason."""
    return json.dumps(dict(failure, launched=launched))


def handed_over() -> dict | None:
    """The failure this attempt recovers from (None: it follows none: the first attempt, a clean restart)."""
    raw = os.environ.get(env_vars.FAILURE, "")
    try:
        d = json.loads(raw) if raw else None
    except ValueError:
        return None
    return d if isinstance(d, dict) and all(isinstance(d.get(k), (int, float)) for k in MARKS[:4]) else None


def process_start() -> float:
    """When this process started (the kernel's record), or now where /proc cannot say."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])  # not /proc/stat's btime: whole seconds
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


def parts(marks: dict[str, float]) -> dict[str, float]:
    """Seconds of each part from the boundaries' times; a boundary out of order (clocks of two machines)
    makes its part 0, never negative, and the total stays first-to-last."""
    out, prev = {}, marks[MARKS[0]]
    for name, mark in zip(PARTS, MARKS[1:], strict=True):
        t = max(marks[mark], prev)
        out[name] = t - prev
        prev = t
    return out


def event_fields(failure: dict, worker: dict[str, float]) -> dict:
    """The `downtime` event's fields: every part, the total (from the outage's first failure), and what failed.
    `failed_attempts_s`: attempts that failed again before their first step, between the two."""
    secs = parts(dict(failure, **worker))
    earlier = max(failure["failed"] - failure.get("since", failure["failed"]), 0.0)
    return {
        "reason": failure.get("reason", ""),
        "total_s": round(sum(secs.values()) + earlier, 3),
        "parts_s": {k: round(v, 3) for k, v in secs.items()},
        **({"failed_attempts_s": round(earlier, 3)} if earlier else {}),
    }


def status_line(events: list[dict]) -> str | None:
    """`status`'s line: the latest restart's downtime part by part, and the median of all of them."""
    downs = [e for e in events if e["event"] == DOWNTIME]
    if not downs:
        return None
    last = downs[-1]
    parts = "  ".join(f"{k} {v:.1f}" for k, v in last["parts_s"].items() if v >= 0.05)
    median = statistics.median(d["total_s"] for d in downs)
    return (
        f"downtime  last {last['total_s']:.1f}s ({last.get('reason', '?')}; training again at step "
        f"{last.get('step')}): {parts}   median {median:.1f}s of {len(downs)}"
    )
