"""The drill's fault schedule and its sizing: a Poisson process at the drill's mean time between failures, in
seconds of training (drawn as exponential gaps, mapped to steps by the calibrated step time), each arrival one of
the kinds available where the drill runs, seeded, landed where trainer.drill.kinds's table lets it; and the steps
a drill of some minutes gets, or the one line that refuses it.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field

from trainer.config import Config
from trainer.drill.kinds import CORRUPTIONS, HANG_TIMEOUTS, KINDS, Kind

# The drill sends a preemption when its 0.2 s poll of the heartbeat sees the planned step: it needs steps left.
PREEMPT_LEAD_S = 0.5
# A drill of fewer faults, or of fewer kinds, shows nothing about a configuration (--min-faults, --min-kinds)
MIN_FAULTS, MIN_KINDS = 8, 4
# A plan drawn for --minutes that falls short of them is grown (more steps, the same mean time between
# failures) up to this many times the minutes, priced; past it the drill refuses before running the drill.
GROW_LIMIT = 1.5
EDGE = 3  # no fault in the first or the last steps of a plan


@dataclass
class Planned:
    kind: str  # a KINDS key
    step: int  # the step it fires at (a hang in a restart: the restore/compile at or after it)
    fault: dict | None  # the trainer's `faults` entry; None for preempt (the drill sends it)


@dataclass
class _Drawn:
    """The schedule so far, in step order, and what the next draws read of it."""

    plan: list[Planned] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)  # where each failure fires, in the order drawn
    used: set[int] = field(default_factory=set)
    last_rewind: int = -(10**9)

    def add(self, kind: str, step: int, fault: dict | None) -> None:
        if KINDS[kind].rewinds:
            self.last_rewind = step
        if KINDS[kind].restarts:
            self.failed.append(step)
        self.used.add(step)
        self.plan.append(Planned(kind, step, fault))
        self.plan.sort(key=lambda p: p.step)


def fires_at(row: Kind, step: int, every: int) -> int:
    """Where a fault drawn at `step` fires (FIRES): a crash after a save, the step after the next save; a crash
    in a save, in the first save at or after its step; any other, there."""
    if row.fires == "after_save":
        return (step // every + 1) * every + 1
    if row.fires == "in_save" and every:
        return -(-step // every) * every
    return step


def failure_before(plan: list[Planned], step: int) -> int | None:
    """The failure whose restart a hang at `step` would fire in: the last one planned before it, unless a hang
    in a restart follows it already. Read in step order, not in the order drawn: a crash after or in a save is
    planned at that save, after faults drawn later."""
    for p in reversed(plan):
        if p.step >= step:
            continue
        if KINDS[p.kind].fires == "restart":
            return None
        if KINDS[p.kind].restarts:
            return p.step
    return None


def slow_from(cfg: Config, failure: int | None) -> int:
    """A slowdown is seen against the pace before it: the throughput alert's window of steps (and, with several
    processes, the straggler watch's grace and two windows) since the start or the restart."""
    need = max(cfg.alerts.throughput_window, cfg.straggler.grace_steps + 2 * cfg.straggler.window_steps) + 5
    return need + (0 if failure is None else failure + 1)


def budget(cfg: Config, at_most: str, spares: int) -> int:
    """How many faults of the kinds sharing the budget `at_most` (a BUDGETS key) one plan may hold."""
    return {"once": 1, "spares": spares, "runbook": cfg.runbook.max_actions}[at_most]


def spent(plan: list[Planned], at_most: str) -> int:
    """How many faults of the plan are of the kinds sharing the budget `at_most`."""
    return sum(KINDS[p.kind].at_most == at_most for p in plan)


def lands(cfg: Config, kind: str, step: int, drawn: _Drawn, *, steps: int, step_s: float, spares: int) -> bool:
    """Whether a fault of `kind` drawn at `step` may land there: what it needs is behind it, its budget is not
    spent, it is spaced from the other rewinds, and it fires in time (before the last steps)."""
    row, rb = KINDS[kind], cfg.runbook
    if row.needs == "failure" and failure_before(drawn.plan, step) is None:
        return False
    if row.needs == "warmup" and step < rb.warmup_steps + rb.min_history:
        return False
    if row.needs == "pace" and step < slow_from(cfg, drawn.failed[-1] if drawn.failed else None):
        return False
    if row.rewinds and step - drawn.last_rewind <= rb.recur_distance:
        return False
    if row.at_most and spent(drawn.plan, row.at_most) >= budget(cfg, row.at_most, spares):
        return False
    if row.fires in ("after_save", "in_save") and fires_at(row, step, cfg.checkpoint.every_steps) >= steps - EDGE:
        return False
    return not (row.by_drill and step >= steps - EDGE - math.ceil(PREEMPT_LEAD_S / step_s))


def entry(cfg: Config, kind: str, step: int, plan: list[Planned], rng: random.Random) -> dict | None:
    """The trainer's `faults` entry for a fault of `kind` planned at `step` (None: the drill sends it)."""
    row, every = KINDS[kind], cfg.checkpoint.every_steps
    if row.by_drill:
        return None
    if row.fires == "restart":
        # the restart after the last failure restores at its checkpoint, at most one interval back
        # (at least 1: a fresh start enters the restore phase too, at step 0, before any failure)
        step = max((failure_before(plan, step) // every - 1) * every, 1) if every else 1
    fault: dict = {"kind": row.fault or kind, "step": step}
    if row.phase:
        fault["phase"] = row.phase
    fault.update(row.fixed)
    if row.draws == "how":
        fault["how"] = rng.choice(CORRUPTIONS)
    elif row.draws == "process":
        fault["process"] = rng.randrange(cfg.launch.processes_per_node, cfg.launch.processes)
    return fault


def schedule(
    cfg: Config, *, steps: int, step_s: float, mtbf_s: float, kinds: list[str], seed: int, spares: int = 0
) -> list[Planned]:
    """Faults over `steps` steps: exponential gaps of mean `mtbf_s` seconds of training (`step_s` a step), none in
    the first EDGE steps or the last EDGE, at most one a step, each of a kind drawn uniformly from those of `kinds`
    that land there (lands(): the table's needs, budgets and spacing), and failures at least 2 steps apart
    where they fire (the supervisor reads a failure the step after another as the same step failing again)."""
    rng, drawn, t = random.Random(seed), _Drawn(), 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        step = max(int(t / step_s), EDGE)
        if step >= steps - EDGE:
            return drawn.plan
        while step in drawn.used:
            step += 1
        choices = [k for k in kinds if lands(cfg, k, step, drawn, steps=steps, step_s=step_s, spares=spares)]
        if not choices:
            continue
        kind = rng.choice(choices)
        step = fires_at(KINDS[kind], step, cfg.checkpoint.every_steps)
        if step in drawn.used:
            continue
        # drawn before the crash-loop check below: moving a draw of the rng would change every seed's plan
        fault = entry(cfg, kind, step, drawn.plan, rng)
        if KINDS[kind].restarts and any(abs(step - f) < 2 for f in drawn.failed):
            continue
        drawn.add(kind, step, fault)


class Refused(ValueError):
    """The drill cannot show anything in the minutes it was given: one line saying why and what to change."""


@dataclass
class Sized:
    steps: int
    plan: list[Planned]
    priced_s: float  # the plan's wall, priced: start-up, its steps, each fault's cost
    grown_from: int  # the steps --minutes gave, when the plan was grown to hold the faults (else 0)


def fault_s(cfg: Config, kind: str, *, step_s: float, startup_s: float) -> float:
    """What a fault costs the drill: a start-up, half a checkpoint interval recomputed, and a hang its
    phase's timeout (it is found when the timeout runs out)."""
    every = cfg.checkpoint.every_steps or cfg.train.steps
    hang = getattr(cfg.supervisor, KINDS[kind].hang_timeout) if KINDS[kind].hang_timeout else 0.0
    return startup_s + every * step_s / 2 + hang


def priced_s(cfg: Config, plan: list[Planned], steps: int, *, step_s: float, startup_s: float) -> float:
    return startup_s + steps * step_s + sum(fault_s(cfg, p.kind, step_s=step_s, startup_s=startup_s) for p in plan)


def mean_fault_s(cfg: Config, kinds: list[str], *, step_s: float, startup_s: float) -> float:
    """fault_s averaged over `kinds` (each as likely as the others)."""
    return sum(fault_s(cfg, k, step_s=step_s, startup_s=startup_s) for k in kinds) / len(kinds)


def need_s(cfg: Config, kinds: list[str], faults: int, *, mtbf_s: float, step_s: float, startup_s: float) -> float:
    """The wall `faults` faults drawn from `kinds` take on average: a start-up, and each fault the mean
    time between failures of training and its cost."""
    return startup_s + faults * (mtbf_s + mean_fault_s(cfg, kinds, step_s=step_s, startup_s=startup_s))


def check(
    cfg: Config,
    kinds: list[str],
    *,
    minutes: float,
    mtbf_s: float,
    named: bool,
    min_faults: int = MIN_FAULTS,
    min_kinds: int = MIN_KINDS,
    step_s: float = 0.0,
    startup_s: float = 0.0,
) -> None:
    """Refused when the kinds are too few, or when `min_faults` faults cannot fit GROW_LIMIT x the minutes
    on average (before calibration, step_s and startup_s 0: counting the mean time between failures and the
    hang timeouts alone)."""
    if len(kinds) < min_kinds:
        what = f"--faults names {len(kinds)} kind(s)" if named else f"only {len(kinds)} kind(s) can be drilled here"
        raise Refused(
            f"{what} ({', '.join(kinds)}): a drill of fewer than {min_kinds} kinds shows little about a "
            f"configuration; {'name more' if named else 'see why the others cannot'}, or lower --min-kinds"
        )
    ask = dict(minutes=minutes, mtbf_s=mtbf_s, step_s=step_s, startup_s=startup_s, min_faults=min_faults)
    if need_s(cfg, kinds, min_faults, mtbf_s=mtbf_s, step_s=step_s, startup_s=startup_s) > GROW_LIMIT * minutes * 60:
        raise Refused(refusal(cfg, kinds, **ask, min_kinds=min_kinds))


def refusal(
    cfg: Config,
    kinds: list[str],
    *,
    minutes: float,
    mtbf_s: float,
    step_s: float,
    startup_s: float,
    min_faults: int,
    min_kinds: int,
    drawn: tuple[int, int, float] | None = None,
) -> str:
    """The one line that says why `minutes` cannot hold the faults: the minutes they need, what each fault
    was priced at (the hang timeouts), and what to lower. `drawn`: the grown draw that still fell short
    (faults, kinds, priced seconds). Uncalibrated (step_s 0), a lower bound."""
    sc, n, calibrated = cfg.supervisor, min_faults, step_s > 0
    about = "~" if calibrated else "at least "
    need = need_s(cfg, kinds, n, mtbf_s=mtbf_s, step_s=step_s, startup_s=startup_s)
    line = (
        f"{n} faults of {min_kinds}+ kinds at one every {mtbf_s:g} s of training need {about}{need / 60:.1f} min here"
    )
    if drawn is not None:
        line += (
            f"; this seed's draw, grown until its price passed {GROW_LIMIT:g}x the {minutes:g} min asked "
            f"({drawn[2] / 60:.1f} min), held {drawn[0]} fault(s) of {drawn[1]} kind(s)"
        )
    else:
        line += f", not {minutes:g} (a drill grows to {GROW_LIMIT:g}x its minutes at most)"
    restart = fault_s(cfg, "crash", step_s=step_s, startup_s=startup_s)
    if calibrated:
        line += (
            f": each fault priced at a restart ({startup_s:.0f} s start-up + {restart - startup_s:.0f} s recomputed)"
        )
    hangs = [k for k in kinds if k in HANG_TIMEOUTS]
    fixes = []
    if hangs:
        settings = dict.fromkeys(HANG_TIMEOUTS[k] for k in hangs)
        mean_hang = sum(getattr(sc, HANG_TIMEOUTS[k]) for k in hangs) / len(kinds)
        priced = ", ".join(f"supervisor.{s} {getattr(sc, s):g} s" for s in settings)
        line += (
            f"{',' if calibrated else ':'} a hang its phase's timeout, waited out ({priced}: "
            f"{mean_hang:.0f} s a fault on average over the {len(kinds)} kinds)"
        )
        fit = (minutes * 60 - startup_s) / n - mtbf_s - restart
        fixes.append(
            f"lower those timeouts (to under {fit:.0f} s a fault on average{'' if calibrated else ' less a restart'})"
            if fit > 0
            else "lower those timeouts"
        )
        rest = [k for k in kinds if k not in HANG_TIMEOUTS]
        if len(rest) >= min_kinds:
            without = need_s(cfg, rest, n, mtbf_s=mtbf_s, step_s=step_s, startup_s=startup_s)
            fixes.append(f"leave the hang kinds out (--faults {','.join(rest)}: {about}{without / 60:.1f} min)")
    fixes.append(f"drill --minutes {math.ceil(need / 60)}{' or more' if not calibrated else ''}")
    return f"{line}; {', '.join(fixes[:-1])}{', or ' if fixes[:-1] else ''}{fixes[-1]}"


def size(
    cfg: Config,
    kinds: list[str],
    *,
    minutes: float,
    mtbf_s: float,
    step_s: float,
    startup_s: float,
    seed: int,
    spares: int = 0,
    min_faults: int = MIN_FAULTS,
    min_kinds: int = MIN_KINDS,
) -> Sized:
    """The drill's steps and schedule: the steps that make about `minutes` of drilling at `mtbf_s` (each fault
    priced as fault_s), drawn; a draw short of `min_faults` faults of `min_kinds` kinds is grown, step by step
    at the same mean time between failures, until it holds them, as long as its price stays within
    GROW_LIMIT x the minutes. Refused (one line: refusal()) when it cannot."""
    mean = mean_fault_s(cfg, kinds, step_s=step_s, startup_s=startup_s)
    steps = first = max(int((minutes * 60 - startup_s) / (step_s * (1 + mean / mtbf_s))), 20)
    limit = GROW_LIMIT * minutes * 60
    while True:
        drawn = schedule(cfg, steps=steps, step_s=step_s, mtbf_s=mtbf_s, kinds=kinds, seed=seed, spares=spares)
        price = priced_s(cfg, drawn, steps, step_s=step_s, startup_s=startup_s)
        holds = len(drawn) >= min_faults and len({p.kind for p in drawn}) >= min_kinds
        if holds and (steps == first or price <= limit):
            return Sized(steps, drawn, price, 0 if steps == first else first)
        if price > limit:
            ask = dict(minutes=minutes, mtbf_s=mtbf_s, step_s=step_s, startup_s=startup_s, min_faults=min_faults)
            drawn_kinds = len({p.kind for p in drawn})
            raise Refused(refusal(cfg, kinds, **ask, min_kinds=min_kinds, drawn=(len(drawn), drawn_kinds, price)))
        steps += max(steps // 10, int(mtbf_s / step_s), 1)


def as_dicts(plan: list[Planned]) -> list[dict]:
    return [asdict(p) for p in plan]
