"""When a group is hung, what it points at, and the stacks its workers dump before the kill: the supervisor's
helpers for a hang (trainer.supervise.supervisor judges each poll's heartbeats with them). No jax here."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from trainer.config import Phase
from trainer.observe import heartbeat
from trainer.observe.alerts import ALERTS, Kind
from trainer.observe.heartbeat import Beat, Pulse
from trainer.store import rundir
from trainer.store.event_names import ALERT, ALERT_CLEARED, HANG_DETECTED, STACKS_DUMPED
from trainer.supervise import group


@dataclass(frozen=True)
class Standing:
    """Where one process stands at a poll: its phase, since when, at which step (before its first beat: in
    startup since the attempt began, at no step)."""

    process: int
    phase: Phase
    since: float
    step: int | None


@dataclass(frozen=True)
class Silence:
    """The group's silence at one poll, judged by the process least overdue for its own phase's timeout: the
    group is hung once even that one is."""

    phase: Phase
    since: float  # that process's last beat (the attempt's start, before its first)
    step: int | None  # the group's lowest step
    silent_s: float
    timeout_s: float
    beats: list[Standing]  # every process's, in process order: what hung_on judges


def silence(hbs: Sequence[Beat | None], started: float, timeout: Callable[[Phase], float]) -> Silence:
    """`hbs`: each process's heartbeat in this attempt (None before its first); `timeout(phase)`: its limit."""
    # Processes move in lockstep: one waiting in a collective for a slower peer (still compiling, say)
    # is not hung. The group is hung once every process is overdue for its own phase.
    beats = [
        Standing(i, hb.phase, hb.time, hb.step) if hb else Standing(i, Phase.STARTUP, started, None)
        for i, hb in enumerate(hbs)
    ]
    least = min(beats, key=lambda b: (time.time() - b.since) / timeout(b.phase))
    # Say where the group is stuck: its lowest step (hosts dispatch a step ahead of their devices, so the
    # peers of a hung process may have started the next one before waiting on it).
    step = min((b.step for b in beats if b.step is not None), default=least.step)
    return Silence(least.phase, least.since, step, time.time() - least.since, timeout(least.phase), beats)


class Overdue:
    """ "No step completed for too long": an alert while there is still time to look, well before the hang
    timeout kills the worker (at `fraction` of it); cleared as soon as the heartbeat moves again."""

    def __init__(self, fraction: float, write: Callable[..., None]):
        self.fraction, self.write = fraction, write
        self.about: tuple | None = None  # (pid, heartbeat time) of the silence the open alert is about

    def check(self, pid: int, s: Silence) -> None:
        limit = self.fraction * s.timeout_s
        if s.silent_s > limit and self.about is None:
            self.about = (pid, s.since)
            meaning, action = ALERTS[Kind.STEP_OVERDUE]
            self.write(
                ALERT,
                step=s.step,
                kind=Kind.STEP_OVERDUE,
                phase=s.phase,
                silent_s=s.silent_s,
                detail=f"phase {s.phase}: no heartbeat for {s.silent_s:.0f}s (alert at {limit:.0f}s, "
                f"killed at {s.timeout_s:.0f}s)",
                meaning=meaning,
                runbook=action,
            )
        elif self.about is not None and self.about != (pid, s.since):
            self.about = None
            self.write(ALERT_CLEARED, step=s.step, kind=Kind.STEP_OVERDUE, detail=f"heartbeat moved ({s.phase})")


@dataclass(frozen=True)
class Pulses:
    """Every process's pulse at one poll, judged: the process that stopped while a peer went on (None: none did),
    its silence, and the largest silence of the processes still alive (how close a live one came to a verdict)."""

    frozen: int | None
    frozen_s: float
    live_max_s: float
    failed: float = 0.0  # when the frozen process failed: within a pulse period after its last pulse (midpoint)


def pulses(ps: Sequence[Pulse | None], now: float) -> Pulses:
    """`ps`: each process's pulse in this attempt (heartbeat.read_pulse; None before its first). A process is
    frozen when its pulse is over PULSE_STALE_S old while a peer's is at most PULSE_FRESH_S old: its peers are
    alive and, in lockstep, wait for it. Not judged: a process with no pulse yet (still starting: the startup
    timeout covers it) or one leaving on purpose; nor a group that is silent as a whole (a stalled shared disk,
    a suspended machine: the hang timeouts cover it)."""
    ages = {i: now - p.time for i, p in enumerate(ps) if p is not None and not p.ending}
    fresh = any(a <= heartbeat.PULSE_FRESH_S for a in ages.values())
    stale = [i for i, a in ages.items() if a > heartbeat.PULSE_STALE_S]
    live = [a for a in ages.values() if a <= heartbeat.PULSE_STALE_S]
    culprit = min(stale, key=lambda i: ps[i].time) if stale and fresh else None
    if culprit is None:
        return Pulses(None, 0.0, max(live, default=0.0))
    return Pulses(culprit, ages[culprit], max(live, default=0.0), heartbeat.after_last_pulse(ps[culprit]))


def frozen(ps: Sequence[Pulse | None], proc: group.Group, write: Callable, *, step: int | None) -> Pulses:
    """Judge the group's pulses now; a frozen process (its node lost or gone silent, the process stopped) gets
    its hang_detected event (phase "frozen"), its node the blame, and one line on stderr. No stack dump: a
    frozen process cannot answer, and its peers only wait for it. The caller kills the group. `ps`: the poll's
    pulses (heartbeat.Snapshot.pulses)."""
    v = pulses(ps, time.time())
    if v.frozen is None:
        return v
    node = ps[v.frozen].node
    why = f"its process {v.frozen} froze (no sign of life for {v.frozen_s:.1f} s) while its peers went on"
    write(
        HANG_DETECTED,
        step=step,
        pid=proc.pid,
        phase="frozen",
        silent_s=v.frozen_s,
        timeout_s=heartbeat.PULSE_STALE_S,
        process=v.frozen,
        node=node,
        why=why,
    )
    print(f"supervisor: the group is stuck: {why}{f' (node {node})' if node else ''}; restarting", file=sys.stderr)
    if node:
        proc.blame_node(node, why)
    return v


def hung_on(
    beats: Sequence[Standing], hbs: Sequence[Beat | None], pulses: Sequence[Pulse | None]
) -> tuple[int, str, str]:
    """(process, node, why) the hang points at. A frozen process (SIGSTOP, a node gone silent) stops
    pulsing while its peers, blocked in a collective waiting for it, still pulse; when all pulse (a stuck
    kernel), the process furthest behind: lowest step, then oldest beat. `beats`: Silence.beats; `hbs`: their
    heartbeats; `pulses`: their pulses (heartbeat.Snapshot.pulses)."""
    now = time.time()
    frozen = [i for i, p in enumerate(pulses) if p is None or now - p.time > heartbeat.PULSE_STALE_S]
    if frozen and len(frozen) < len(pulses):
        i = frozen[0]
        age = f"{now - pulses[i].time:.0f} s" if pulses[i] else "ever"
        why = f"its process {i} froze (no sign of life for {age}) while its peers waited for it"
    else:
        b = min(beats, key=lambda b: (b.step if b.step is not None else -1, b.since))
        i = b.process
        why = f"its process {i} was furthest behind when the group hung ({b.phase}, step {b.step})"
    return i, hbs[i].node if hbs[i] else "", why


def dump_stacks(run_dir: Path, proc: group.Group, hbs: Sequence[Beat | None], write: Callable) -> None:
    """The workers registered faulthandler on SIGUSR1: ask every process for its Python stacks before
    the kill (under SLURM their pids are known only from their heartbeats)."""
    pids = proc.worker_pids() or [hb.pid for hb in hbs if hb and hb.pid]
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
