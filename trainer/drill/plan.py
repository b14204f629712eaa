"""The drill's fault schedule: a Poisson process at the drill's mean time between failures, in seconds of
training (drawn as exponential gaps, mapped to steps by the calibrated step time), each arrival one of the
kinds available where the drill runs, seeded. Some kinds land in the awkward places on purpose: a crash the
step after a periodic save (while it is still being written), a hang in the restore or the compile of the
restart after a failure, a crash while a save is in flight, a corrupted newest checkpoint.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

from trainer.config import CORRUPT_HOW, Config, Phase

# kind: (what the trainer's fault list gets, in words). "preempt" is the drill's own: a SIGTERM to the
# supervisor, as a scheduler sends it; every other kind is a `faults` entry the workers fire themselves.
KINDS = {
    "crash": "the worker process dies (SIGKILL-like exit) at a step",
    "crash_after_save": "the worker dies the step after a periodic save, while the save is in flight",
    "hang": "the step hangs (alive, no progress), as in a stuck collective",
    "hang_startup": "the start-up of the restart after a failure hangs (e.g. a peer that never joins)",
    "hang_restore": "the restore of the restart after a failure hangs",
    "hang_compile": "the compile of the restart after a failure hangs",
    "hang_checkpoint": "a save hangs (storage that stops answering)",
    "hang_eval": "a held-out eval hangs",
    "crash_mid_save": "the worker dies while a save is being written",
    "corrupt": "the newest durable checkpoint gets flipped bytes, a truncated file or torn metadata; then a crash",
    "preempt": "SIGTERM to the supervisor, as a scheduler preempting the job; the drill requeues it",
    "spike": "one update with a 1000x LR: the loss spike runbook rewinds and skips",
    "nan": "one update turns the params NaN: the runbook rewinds and skips",
    "ecc": "a host's ECC error count rises: checkpoint now",
    "slow": "one process's host work slows 3x for 20 steps",
    "bitflip": "one replica's params get a flipped bit (silent data corruption): caught and rewound",
    "disk_full": "a durable save finds the disk full (ENOSPC, injected): the supervisor waits for room, restarts",
    "node": "a whole node lost (its processes, slurmd and node-local tier at once); a spare takes its place",
}
RESTARTS = {"crash", "crash_after_save", "hang", "crash_mid_save", "corrupt", "preempt", "spike", "nan", "bitflip"}
RESTARTS |= {"node", "disk_full", "hang_checkpoint", "hang_eval"}  # (one literal would pass the line limit)
AFTER_RESTART = {"hang_startup", "hang_restore", "hang_compile"}  # fire in the restart after an earlier failure
IN_PHASE = {"hang_checkpoint", "hang_eval"}  # fire the first time their phase is entered at or after their step
CORRUPTIONS = CORRUPT_HOW  # what a corrupt fault may do: the config's faults[].how (trainer.config owns it)
SLOW_STEPS, SLOW_MULTIPLE = 20, 3.0
# The drill sends a preemption when its poll of the heartbeat (every 0.2 s, run.py) sees the planned step: one
# planned 4 steps from the end of a 28 ms-a-step run was outrun (the run finished first, the drill failed).
PREEMPT_LEAD_S = 0.5  # 2.5 polls
# A drill of fewer faults, or of fewer kinds, shows nothing about a configuration (--min-faults, --min-kinds)
MIN_FAULTS, MIN_KINDS = 8, 4
# A plan drawn for --minutes that falls short of them is grown (more steps, the same mean time between
# failures) up to this many times the minutes, priced; past it the drill refuses before running the drill.
GROW_LIMIT = 1.5
# the supervisor's timeout each hang waits out before it is found: its phase's (a SupervisorConfig field)
HANG_TIMEOUTS = {"hang": Phase.STEP.timeout_field} | {
    f"hang_{p}": p.timeout_field for p in (Phase.STARTUP, Phase.COMPILE, Phase.RESTORE, Phase.CHECKPOINT, Phase.EVAL)
}


@dataclass
class Planned:
    kind: str  # a KINDS key
    step: int  # the step it fires at (after_restart kinds: the restore/compile at or after it)
    fault: dict | None  # the trainer's `faults` entry; None for preempt (the drill sends it)


def available(cfg: Config, spares: int | None = None) -> tuple[list[str], dict[str, str]]:
    """The kinds this configuration can be drilled with here, and why each other one is left out. `spares`:
    the allocation's nodes beyond the configuration's (None: not inside a SLURM allocation)."""
    out: dict[str, str] = {}
    if spares is None or cfg.launch.mode != "slurm":
        out["node"] = "not inside a SLURM allocation (sbatch launch/slurm.sbatch drill ...): no node to lose"
    elif cfg.launch.processes <= cfg.launch.processes_per_node:
        out["node"] = "one node trains: losing it loses the drill too; drill with launch.processes over 2 nodes"
    elif spares < 1:
        out["node"] = "no spare node in the allocation: a lost node could not be replaced; allocate one more"
    if not cfg.integrity.replica_check_steps:
        out["bitflip"] = "integrity.replica_check_steps is 0: nothing would look for a flipped bit"
    if not cfg.runbook.enabled:
        out["spike"] = out["nan"] = "runbook.enabled is false: a spike would train on"
    if not cfg.log.health:
        out["ecc"] = "log.health is false: no health monitor reads ECC counts"
    if not cfg.checkpoint.every_steps:
        out["crash_after_save"] = "checkpoint.every_steps is 0: no periodic save to crash after"
    if not cfg.eval.every_steps:
        out["hang_eval"] = "eval.every_steps is 0: no eval to hang"
    if not (cfg.checkpoint.every_steps or cfg.checkpoint.every_minutes):
        out["disk_full"] = "no periodic durable save: none to find the disk full"
    elif not cfg.supervisor.storage_wait_minutes:
        out["disk_full"] = "supervisor.storage_wait_minutes is 0: a full disk stops the run for a human"
    return [k for k in KINDS if k not in out], out


def schedule(
    cfg: Config, *, steps: int, step_s: float, mtbf_s: float, kinds: list[str], seed: int, spares: int = 0
) -> list[Planned]:
    """Faults over `steps` steps: exponential gaps of mean `mtbf_s` seconds of training (`step_s` a step), none in the
    first 3 steps or the last 3, at most one a step, and failures at least 2 steps apart where they fire (a crash
    in a save fires at the first save at or after its step, so it is planned there: drawn anywhere, several
    landed on one save, and the supervisor reads a crash the step after as the same step failing again: three
    made a crash loop and the drill failed on its own plan, seen at 28 ms a step, 59 steps and one save).
    Kinds drawn uniformly from `kinds`, except where one cannot land: a hang in a restart needs an earlier
    failure, and one is all it gets (the same checkpoint failing three restarts in a row is a crash loop, which
    stops the run); a slowdown, the pace before it; a spike needs the runbook's warm-up behind it and a gap of
    runbook.recur_distance from any other spike or NaN (a recurrence would soften the LR, which no undisturbed
    run can match), and no more spikes and NaNs than runbook.max_actions (one more and the runbook stops the
    run for a human); ECC fires once (its alert stays open); a node is lost at most once per spare (SLURM marks
    it down for good), never the first node's (the drill runs there)."""
    rng = random.Random(seed)
    plan: list[Planned] = []
    every = cfg.checkpoint.every_steps
    spike_from = cfg.runbook.warmup_steps + cfg.runbook.min_history
    t, used, last_rewind = 0.0, set(), -(10**9)
    failed: list[int] = []  # where each failure fires, in the order drawn

    def fires_at(kind: str, step: int) -> int:
        """Where a fault drawn at `step` fires: a crash after a save, the step after the next save; a crash in a
        save, in the first save at or after its step; any other, there."""
        if kind == "crash_after_save":
            return (step // every + 1) * every + 1
        if kind == "crash_mid_save" and every:
            return -(-step // every) * every
        return step

    def failure_before(step: int) -> int | None:
        """The failure whose restart a hang at `step` would fire in: the last one planned before it, unless a
        hang in a restart follows it already. Read from the plan in step order, not in the order drawn: a crash
        after or in a save is planned at that save, after faults drawn later."""
        for p in reversed(plan):
            if p.step >= step:
                continue
            if p.kind in AFTER_RESTART:
                return None
            if p.kind in RESTARTS:
                return p.step
        return None

    def slow_from(failure: int | None) -> int:
        """A slowdown is seen against the pace before it: the throughput alert's window of steps (and, with
        several processes, the straggler watch's grace and two windows) since the start or the restart."""
        need = max(cfg.alerts.throughput_window, cfg.straggler.grace_steps + 2 * cfg.straggler.window_steps) + 5
        return need + (0 if failure is None else failure + 1)

    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        step = max(int(t / step_s), 3)
        if step >= steps - 3:
            return plan
        while step in used:
            step += 1
        choices = [
            k
            for k in kinds
            if not (k in AFTER_RESTART and failure_before(step) is None)
            and not (k == "spike" and (step < spike_from or step - last_rewind <= cfg.runbook.recur_distance))
            and not (k == "nan" and step - last_rewind <= cfg.runbook.recur_distance)
            and not (k in ("spike", "nan") and sum(p.kind in ("spike", "nan") for p in plan) >= cfg.runbook.max_actions)
            and not (k == "ecc" and any(p.kind == "ecc" for p in plan))
            and not (k == "node" and sum(p.kind == "node" for p in plan) >= spares)
            and not (k == "slow" and step < slow_from(failed[-1] if failed else None))
            and not (k in ("crash_after_save", "crash_mid_save") and fires_at(k, step) >= steps - 3)
            and not (k == "preempt" and step >= steps - 3 - math.ceil(PREEMPT_LEAD_S / step_s))
        ]
        if not choices:
            continue
        kind = rng.choice(choices)
        step = fires_at(kind, step)
        if step in used:
            continue
        fault: dict | None = {"kind": kind, "step": step}
        if kind == "crash_after_save":
            fault = {"kind": "crash", "step": step}
        elif kind in AFTER_RESTART:
            # the restart after the last failure restores at its checkpoint, at most one interval back
            # (at least 1: a fresh start enters the restore phase too, at step 0, before any failure)
            restored = max((failure_before(step) // every - 1) * every, 1) if every else 1
            fault = {"kind": "hang", "step": restored, "phase": kind.split("_")[1]}
        elif kind in IN_PHASE:
            fault = {"kind": "hang", "step": step, "phase": kind.split("_")[1]}
        elif kind == "corrupt":
            fault["how"] = rng.choice(CORRUPTIONS)
        elif kind == "slow":
            fault.update(count=SLOW_STEPS, step_multiple=SLOW_MULTIPLE)
        elif kind == "preempt":
            fault = None
        elif kind == "node":  # a process past the first node's: the drill and the supervisor live there
            fault["process"] = rng.randrange(cfg.launch.processes_per_node, cfg.launch.processes)
        if kind in RESTARTS and any(abs(step - f) < 2 for f in failed):
            continue  # the supervisor reads failures a step apart as one step failing again (a crash loop)
        if kind in ("spike", "nan"):
            last_rewind = step
        if kind in RESTARTS:
            failed.append(step)
        used.add(step)
        plan.append(Planned(kind, step, fault))
        plan.sort(key=lambda p: p.step)


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
    hang = getattr(cfg.supervisor, HANG_TIMEOUTS[kind]) if kind in HANG_TIMEOUTS else 0.0
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
