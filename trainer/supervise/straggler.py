"""Which process is slow: the supervisor's straggler verdict, from the timing every worker puts in its
heartbeat. No jax here.

In lockstep training every process's step takes the same wall time T: the collectives wait for the slowest.
Each worker reports, over its clean steps, its wait (blocked on the device and the group: reading a step's
results, and on XLA:CPU the step call itself) and its own time (the rest: data, dispatch, the per-step
agreement's RPC, other host work). A host that keeps up queues the next step and then waits on its device;
the host the group waits for never does: its wait falls to nothing while its own time fills the step. So a
straggler is a process that is host-bound (wait under CRITICAL of T, or its steps run inside the step call,
as XLA:CPU runs a one-device process's: then no host work overlaps its device) with more own time than its
peers' median, accounting for at least half of what the group lost, and the group's step is slower than in
its last calm windows by `straggler.factor`. A slower host that still keeps ahead of its device costs
nothing (its wait absorbs it) and is no straggler. On GPUs the step call only queues kernels and the wait is
in reading results; the rule is the same.

Only clean steps count (no save, eval or restore near them: the worker leaves out `straggler.grace_steps`
steps after each), and a verdict needs `straggler.windows` consecutive windows of `window_steps` clean steps
on every process: a recompile or a one-off pause never makes one. Windows are cut by the workers (every
window_steps clean steps, the same steps on every process), not by the supervisor's polls: a poll-cut window
straddles a slowdown's onset or end. docs/multihost.md#stragglers has the measurements behind these rules.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from trainer.config import StragglerConfig
from trainer.observe.alerts import ALERTS, Kind
from trainer.observe.heartbeat import Beat
from trainer.store.event_names import ALERT, ALERT_CLEARED, STRAGGLER, STRAGGLER_CLEARED

CRITICAL = 0.1  # a process waiting less than this part of the step is the one its peers wait for
EXPLAINS = 0.5  # ... and its excess own time must account for at least this part of what the group lost
SECTIONS = ("data", "dispatch", "host")  # where a straggler's own time goes (host: the rest of it)
_KEYS = ("n", "step_s", "wait_s", "data_s", "dispatch_s", "sync")
# What StragglerWatch.observe reports: a verdict declared, or its process no slower any more.
DECLARED = "straggler"
CLEARED = "cleared"


@dataclass
class Verdict:
    process: int
    node: str
    section: str  # one of SECTIONS: where its excess time goes
    slowdown: float  # the group's mean step over the windows behind the verdict, over calm_s
    excess_s: float  # seconds per step of its own work beyond its peers' median (the latest window)
    steps: int  # clean steps measured in the windows behind the verdict
    lost_s: float  # group seconds lost to it so far: (step - calm step) x steps
    detail: str = ""
    calm_s: float = 0.0  # the group's step before it: its last calm windows' (with none, step - excess)
    first_step: int = 0  # the windows behind the verdict: training steps first_step..last_step
    last_step: int = 0
    calm_windows: list = field(default_factory=list)  # [first, last] steps of the calm windows calm_s is from


@dataclass
class _Window:
    """Per-process means over one window of clean steps."""

    step_s: list[float]
    wait: list[float]  # a process's time per step blocked on its device and its peers
    sync: list[bool]  # its steps ran inside the step call (results ready on return): its host work never overlaps
    own: list[float]  # a process's own time per step: all but waiting on the others
    sections: dict[str, list[float]]  # the own time split: data, dispatch, host (the rest)
    steps: int
    first: int = 0  # its training steps (process 0's marks: every process marks the same steps)
    last: int = 0


@dataclass
class StragglerWatch:
    cfg: StragglerConfig
    processes: int
    launch: str = ""
    _base: list[dict] = field(default_factory=list)  # every process's counters at the last judged mark
    _streak: dict = field(default_factory=dict)  # process -> (consecutive candidate windows, their sums)
    open: Verdict | None = None  # the verdict standing now
    _calm: int = 0  # windows since the open verdict's process was last named that eased (_eased) or named another
    lost_s: float = 0.0  # lost to the open verdict's process since it was declared
    calm: list[float] = field(default_factory=list)  # the group's step time in the latest calm windows
    calm_spans: list[list[int]] = field(default_factory=list)  # their [first, last] training steps
    _slower: int = 0  # consecutive windows without a candidate but slower than the calm by the factor

    def observe(self, heartbeats: Sequence[Beat | None], launch: str) -> list[tuple[str, Verdict]]:
        """Feed the latest heartbeats of attempt `launch`; returns what changed: ("straggler", verdict) when
        one is declared, ("cleared", verdict) when its process is no slower any more. Each heartbeat carries
        its process's counters at its latest multiples of window_steps clean steps (its marks); a window is
        judged once every process has marked it, so all are compared over the same steps."""
        if (
            launch != self.launch or not self._base
        ):  # a new attempt: its counters start over (the standing verdict is ended by end())
            self.launch, self._base, self._streak = launch, [dict.fromkeys(_KEYS, 0.0)] * self.processes, {}
        marks = [hb.timing if hb else None for hb in heartbeats]
        if len(marks) != self.processes or not all(isinstance(m, list) for m in marks):
            return []
        by_n = [{m["n"]: m for m in ms if isinstance(m, dict) and "n" in m} for ms in marks]
        nodes = [hb.node if hb else "" for hb in heartbeats]
        out = []
        for n in sorted(set(by_n[0]).intersection(*by_n[1:])):
            if n > self._base[0]["n"]:  # a window missed (4 behind) is merged into the next: means, not sums
                now = [{k: float(b[n].get(k, 0.0)) for k in _KEYS} for b in by_n]
                window, self._base = _window(now, self._base), now
                # its clean steps end at the mark's step (consecutive, unless a save or eval fell among them)
                window.last = int(by_n[0][n].get("step", 0))
                window.first = window.last - window.steps + 1
                out += self._judge(window, nodes)
        return out

    def _judge(self, w: _Window, nodes: list[str]) -> list[tuple[str, Verdict]]:
        out = []
        found = {p: v for p in range(self.processes) if (v := self._candidate(w, p, nodes[p])) is not None}
        if not found:
            self._admit_calm(statistics.median(w.step_s), [w.first, w.last])
        else:
            self._slower = 0
        for p in list(self._streak):
            if p not in found:
                del self._streak[p]
        for p, v in found.items():  # sums over its consecutive candidate windows (first step: the first's)
            n, (steps, lost, calm_s, first) = self._streak.get(p, (0, (0, 0.0, 0.0, v.first_step)))
            self._streak[p] = (n + 1, (steps + v.steps, lost + v.lost_s, calm_s + v.calm_s * v.steps, first))
        if self.open is not None:
            if self.open.process in found:
                self._calm = 0
                self.lost_s += found[self.open.process].lost_s
            elif found or self._eased(w):
                self._calm += 1
                if self._calm >= self.cfg.windows:
                    out.append((CLEARED, self._close()))
        if self.open is None and found:
            p = max(found, key=lambda q: found[q].slowdown)
            n, streak = self._streak[p]
            if n >= self.cfg.windows:
                self.open, self._calm, self.lost_s = _over(streak, found[p]), 0, 0.0
                out.append((DECLARED, self.open))
        return out

    def _eased(self, w: _Window) -> bool:
        """Whether a window in which no one was named counts toward clearing the open verdict: its step is
        nearer the calm the verdict was measured against than the pace it named. One still as slow as the
        verdict's pace is the slowdown going on with the machine's load hiding whose it is. The window the
        slowdown ends in counts (one slowed step of ten: about the factor itself, so `factor` would be no line)."""
        v = self.open
        return statistics.median(w.step_s) < v.calm_s * (1 + v.slowdown) / 2

    def _admit_calm(self, step: float, span: list[int]) -> None:
        """A window with no candidate is the new calm unless it is `factor` slower than the calm so far: the
        window a slowdown starts in (half calm, half slow, its process not yet host-bound over the whole
        window) would understate the verdict's slowdown. `windows` such windows in a row are a new pace (a
        slower group, e.g. after a drain), and become the calm."""
        if self.calm and step > self.cfg.factor * statistics.median(self.calm) and self._slower < self.cfg.windows - 1:
            self._slower += 1
            return
        self.calm, self._slower = [*self.calm, step][-self.cfg.windows :], 0
        self.calm_spans = [*self.calm_spans, span][-self.cfg.windows :]

    def _candidate(self, w: _Window, p: int, node: str) -> Verdict | None:
        """Process p's verdict for this window: host-bound, more own time than its peers' median (with 3 or
        more peers, also by more than mad_k times their spread), and the group slower by the factor."""
        others = [q for q in range(self.processes) if q != p]
        step = statistics.median(w.step_s)
        if not others or (w.wait[p] > CRITICAL * step and not w.sync[p]):
            return None
        ref = statistics.median(w.own[q] for q in others)
        excess = w.own[p] - ref
        if excess <= 0:
            return None
        if len(others) >= 3 and excess <= self.cfg.mad_k * statistics.median(abs(w.own[q] - ref) for q in others):
            return None
        calm = statistics.median(self.calm) if self.calm else max(step - excess, 1e-3 * step)
        slowdown = step / calm
        if slowdown < self.cfg.factor or excess < EXPLAINS * (step - calm):  # slower, but not by its own work
            return None

        def section_excess(s: str) -> float:
            return w.sections[s][p] - statistics.median(w.sections[s][q] for q in others)

        section = max(SECTIONS, key=section_excess)
        detail = ", ".join(f"{s} {section_excess(s) * 1e3:+.1f} ms" for s in SECTIONS)
        detail += f"; {'calm' if self.calm else 'without its excess'}"
        return Verdict(
            p,
            node,
            section,
            slowdown,
            excess,
            w.steps,
            (step - calm) * w.steps,
            detail,
            calm,
            w.first,
            w.last,
            list(self.calm_spans),
        )

    def _close(self) -> Verdict:
        v, self.open, self._calm = self.open, None, 0
        v.lost_s, self.lost_s = self.lost_s, 0.0
        return v

    def end(self) -> Verdict | None:
        """The attempt ended (or its straggler is being drained): the standing verdict, with the seconds lost
        since it was declared, to close in the ledger."""
        return self._close() if self.open is not None else None


def _over(streak: tuple[int, float, float, int], v: Verdict) -> Verdict:
    """The verdict over all its windows (`streak`: their steps, lost seconds, calm seconds (calm x steps) and
    first step): the latest window's section and excess, the group's mean step over every window against its
    calm: one window's mean moves with a single stall of a loaded host."""
    steps, lost, calm_s, first = streak
    calm = calm_s / steps
    step = calm + lost / steps
    v.slowdown, v.calm_s, v.steps, v.lost_s, v.first_step = step / calm, calm, steps, lost, first
    v.detail += f" {calm * 1e3:.0f} ms, step {step * 1e3:.0f} ms"
    return v


def _window(now: list[dict], base: list[dict]) -> _Window:
    d = [{k: c[k] - b[k] for k in _KEYS} for c, b in zip(now, base)]
    wait = [x["wait_s"] / x["n"] for x in d]
    own = [x["step_s"] / x["n"] - v for x, v in zip(d, wait)]
    sections = {"data": [x["data_s"] / x["n"] for x in d], "dispatch": [x["dispatch_s"] / x["n"] for x in d]}
    sections["host"] = [o - a - b for o, a, b in zip(own, sections["data"], sections["dispatch"])]
    sync = [x["sync"] >= x["n"] / 2 for x in d]
    return _Window([x["step_s"] / x["n"] for x in d], wait, sync, own, sections, int(min(x["n"] for x in d)))


def describe(v: Verdict) -> str:
    """One line for the event, the alert and the supervisor's output."""
    where = f" on node {v.node}" if v.node else ""
    return (
        f"process {v.process}{where} slows every step {v.slowdown:.2f}x: the group waits for it, "
        f"{v.excess_s * 1e3:.0f} ms a step of its own work beyond its peers' median, most in {v.section} "
        f"({v.detail}), over {v.steps} clean steps of steps {v.first_step}-{v.last_step}"
    )


def report(what: str, v: Verdict, write: Callable, step: int | None) -> None:
    """A verdict ("straggler": its event, an alert and a line on stderr) or its end ("cleared": the seconds
    lost since the verdict, and the alert cleared), into the run's events."""
    if what == CLEARED:
        write(STRAGGLER_CLEARED, step=step, process=v.process, node=v.node, lost_s=v.lost_s)
        write(ALERT_CLEARED, step=step, kind=Kind.STRAGGLER, detail=f"process {v.process}: verdict ended")
        return
    detail = describe(v)
    meaning, action = ALERTS[Kind.STRAGGLER]
    write(STRAGGLER, step=step, **asdict(v))
    write(ALERT, step=step, kind=Kind.STRAGGLER, detail=detail, meaning=meaning, runbook=action)
    print(f"supervisor: straggler: {detail}", file=sys.stderr)
