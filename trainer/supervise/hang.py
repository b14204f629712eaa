"""What a hung group points at, and the stacks its workers dump before the kill: the supervisor's helpers
for a hang (trainer.supervise.supervisor detects it from the heartbeats). No jax here."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

from trainer.observe import heartbeat, rundir
from trainer.observe.event_names import STACKS_DUMPED
from trainer.supervise import group


def hung_on(run_dir: Path, proc: group.Group, beats: list, hbs: list[dict | None]) -> tuple[int, str, str]:
    """(process, node, why) the hang points at. A frozen process (SIGSTOP, a node gone silent) stops
    pulsing while its peers, blocked in a collective waiting for it, still pulse; when all pulse (a stuck
    kernel), the process furthest behind: lowest step, then oldest beat. `beats`: (phase, time, step,
    process) per process; `hbs`: their heartbeats."""
    now = time.time()
    pulses = [heartbeat.read_pulse(run_dir, i, proc.launch_id) for i in range(proc.processes)]
    frozen = [i for i, p in enumerate(pulses) if p is None or now - p["time"] > heartbeat.PULSE_STALE_S]
    if frozen and len(frozen) < len(pulses):
        i = frozen[0]
        age = f"{now - pulses[i]['time']:.0f} s" if pulses[i] else "ever"
        why = f"its process {i} froze (no sign of life for {age}) while its peers waited for it"
    else:
        i = min(beats, key=lambda b: (b[2] if b[2] is not None else -1, b[1]))[3]
        why = f"its process {i} was furthest behind when the group hung ({beats[i][0]}, step {beats[i][2]})"
    return i, (hbs[i] or {}).get("node", ""), why


def dump_stacks(run_dir: Path, proc: group.Group, hbs: list[dict | None], write: Callable) -> None:
    """The workers registered faulthandler on SIGUSR1: ask every process for its Python stacks before
    the kill (under SLURM their pids are known only from their heartbeats)."""
    pids = proc.worker_pids() or [hb["pid"] for hb in hbs if hb]
    proc.send_signal(signal.SIGUSR1)
    files = [rundir.stack_file(run_dir, pid) for pid in pids]
    sizes: dict = {}

    def written(f) -> bool:  # and no longer growing: faulthandler writes one thread after another
        prev, sizes[f] = sizes.get(f), (f.stat().st_size if f.is_file() else 0)
        return sizes[f] > 0 and sizes[f] == prev

    deadline = time.time() + 3
    while time.time() < deadline and not all(map(written, files)):
        time.sleep(0.1)
    for f in filter(lambda f: sizes.get(f), files):
        write(STACKS_DUMPED, path=str(f))
