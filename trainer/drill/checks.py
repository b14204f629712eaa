"""What the drill proves from the runs it made: each fault detected (by the event that shows it) and healed
(the first step past where the run was), with its times and the steps it cost; data consumed exactly once;
the final params equal to the undisturbed run's; the goodput the ledger measured against the survival
model's prediction for the same measured costs and failure rate; and what in the setup would waste the
most, each failed check one line saying what broke and what to change.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from trainer.config import Config, Phase
from trainer.drill.kinds import AFTER_RESTART, KINDS, RESTARTS
from trainer.drill.plan import MIN_FAULTS, MIN_KINDS, Planned
from trainer.observe import audit
from trainer.observe.alerts import Kind
from trainer.store import ckpt_files as checkpoint_files
from trainer.store import rundir
from trainer.store import summary as run_summary
from trainer.store.event_names import (
    ALERT,
    ALERT_CLEARED,
    CHECKPOINT_FAILED,
    CHECKPOINT_NOW,
    CHECKPOINT_REJECTED,
    CHECKPOINT_SAVED,
    DOWNTIME,
    HANG_DETECTED,
    INIT,
    NODE_SUSPECT,
    PREEMPTED,
    REPLICA_MISMATCH,
    RESTART,
    RESTORE,
    RUN_COMPLETE,
    SPIKE_DETECTED,
    STEP,
    STRAGGLER,
    STRAGGLER_CLEARED,
    WORKER_EXIT,
)
from trainer.survival import model

GOODPUT_TOLERANCE = 0.05  # measured goodput within this (relative) of the model's (or within chance: goodput())


def _detector(kind: str, hit: str):
    """The event that shows a fault of this kind was noticed."""
    if kind in ("crash", "crash_after_save", "crash_mid_save") or (kind == "corrupt" and not hit):
        return lambda e: e["event"] == WORKER_EXIT and e.get("exit_code") not in (0, 75)
    return {
        "corrupt": lambda e: e["event"] == CHECKPOINT_REJECTED,
        **{k: (lambda e: e["event"] == HANG_DETECTED) for k in KINDS if k.startswith("hang")},
        "preempt": lambda e: e["event"] == PREEMPTED,
        "spike": lambda e: e["event"] == SPIKE_DETECTED,
        "nan": lambda e: e["event"] == SPIKE_DETECTED,
        "bitflip": lambda e: e["event"] == REPLICA_MISMATCH,
        "node": lambda e: e["event"] == NODE_SUSPECT,
        "disk_full": lambda e: e["event"] == CHECKPOINT_FAILED,  # the lost node blamed (not the survivors)
        "ecc": lambda e: e["event"] == CHECKPOINT_NOW,
        "slow": lambda e: e["event"] == STRAGGLER or (e["event"] == ALERT and e.get("kind") == Kind.THROUGHPUT_DROP),
    }[kind]


def _healer(kind: str):
    """The event after detection that shows the fault was healed, for kinds that cause no restart."""
    return {
        "ecc": lambda e: e["event"] == CHECKPOINT_SAVED,
        "slow": lambda e: (
            e["event"] == STRAGGLER_CLEARED or (e["event"] == ALERT_CLEARED and e.get("kind") == Kind.THROUGHPUT_DROP)
        ),
    }[kind]


def faults(plan: list[Planned], fired: list[dict], preempts: list[dict], evs: list[dict]) -> list[dict]:
    """One row per fault that fired: kind, step, where; detected by, seconds to detect, seconds to the first
    productive step (a step past the furthest the run had reached), steps recomputed."""
    with_fault = [p for p in plan if p.fault is not None]
    rows = [
        dict(
            kind=with_fault[f["index"]].kind,
            step=f["step"],
            phase=f.get("phase", Phase.STEP),
            t=f["time"],
            hit=f.get("hit", ""),
        )
        for f in fired
    ]
    rows += [dict(kind="preempt", step=p["step"], phase=Phase.STEP, t=p["time"], hit="") for p in preempts]
    rows.sort(key=lambda r: r["t"])
    steps = [e for e in evs if e["event"] == STEP]
    for r in rows:
        t = r["t"]
        det = next((e for e in evs if e["time"] >= t and _detector(r["kind"], r["hit"])(e)), None)
        r.update(detected_by=det["event"] if det else None, detect_s=det["time"] - t if det else None)
        r.update(productive_s=None, recomputed=None, healed=False, downtime_s=None)
        if det is None:
            continue
        if r["kind"] in RESTARTS | AFTER_RESTART:
            best = max((e["step"] for e in steps if e["time"] < t), default=0)
            start = next((e for e in evs if e["time"] > det["time"] and e["event"] in (RESTORE, INIT)), None)
            # counted from the attempt that restarts (a preempted worker steps on until its save)
            since = start["time"] if start is not None else det["time"]
            first = next((e for e in steps if e["time"] > since and e["step"] > best), None)
            # ... or the run ended there: a preemption near the end saves the final step, the requeue completes
            first = first or next((e for e in evs if e["time"] > since and e["event"] == RUN_COMPLETE), None)
            if first is not None:
                r.update(healed=True, productive_s=first["time"] - t)
            if start is not None:
                r["recomputed"] = max(best - start.get("step", 0), 0) if start["event"] == RESTORE else best
            # the restart's own account, failure to its first step (trainer.observe.downtime)
            down = next((e for e in evs if e["time"] > since and e["event"] == DOWNTIME), None)
            r["downtime_s"] = down["total_s"] if down is not None else None
        else:
            heal = next((e for e in evs if e["time"] >= det["time"] and _healer(r["kind"])(e)), None)
            r.update(healed=heal is not None, productive_s=heal["time"] - t if heal else None)
    return rows


def coverage(
    plan: list[Planned],
    fired: list[dict],
    preempts: list[dict],
    *,
    min_faults: int = MIN_FAULTS,
    min_kinds: int = MIN_KINDS,
) -> list[str]:
    """What the drill showed, against what it takes to show anything: a plan of fewer than `min_faults` faults
    or `min_kinds` kinds, a planned fault that never fired (`fired`: the workers' fault log, by index into
    the plan's faults; `preempts`: the preemptions the drill sent), or fewer than those fired: one line each."""
    out = []
    kinds = sorted({p.kind for p in plan})
    if len(plan) < min_faults or len(kinds) < min_kinds:
        out.append(
            f"the plan held {len(plan)} fault(s) of {len(kinds)} kind(s) ({', '.join(kinds) or 'none'}): a drill of "
            f"fewer than {min_faults} faults of {min_kinds} kinds shows nothing about a configuration; more "
            "--minutes, lower hang timeouts (supervisor.*_timeout_s) or fewer hang kinds (--faults)"
        )
    with_fault = [p for p in plan if p.fault is not None]
    done = {f["index"] for f in fired}
    missed = [p for i, p in enumerate(with_fault) if i not in done]
    missed += [p for p in plan if p.kind == "preempt"][len(preempts) :]
    if missed:
        out.append(
            f"{len(missed)} planned fault(s) never fired: "
            + ", ".join(f"{p.kind} at step {p.step}" for p in sorted(missed, key=lambda p: p.step))
            + "; a drill shows nothing about a fault that never fired (see run.log in the drill's dir)"
        )
    shown = [with_fault[f["index"]].kind for f in fired if f["index"] < len(with_fault)]
    shown += ["preempt"] * len(preempts)
    if not out and (len(shown) < min_faults or len(set(shown)) < min_kinds):
        out.append(
            f"{len(shown)} fault(s) of {len(set(shown))} kind(s) fired: fewer than the {min_faults} of {min_kinds} "
            "kinds a drill needs to show anything"
        )
    return out


# Faults that strike at a random point of a checkpoint interval: the survival model's failures, each losing
# half an interval on average. The others are priced as measured: a preemption saves first, a hang in a
# restart has nothing new to lose, crash_after_save, crash_mid_save and corrupt aim at the newest checkpoint
# on purpose (a full interval or more each, by design), a full disk fails a save (the interval before it is
# lost), and a lost node restores from whichever tier still holds a complete step without it (the fast
# tier's peer copy, or the durable tier).
UNIFORM = {"crash", "hang", "spike", "nan", "bitflip"}


def interval_steps(cfg: Config) -> int:
    """Steps between the checkpoints a crash resumes from: the durable tier's, else the fast tier's (0: none
    by steps)."""
    ck = cfg.checkpoint
    return ck.every_steps or (ck.local_every_steps if ck.local_dir else 0)


def goodput(summary: dict, rows: list[dict], cfg: Config, step_s: float) -> dict | None:
    """The ledger's goodput of the drilled run (its one-time start-up and shutdown left out) against the
    survival model's expectation for the same measured costs: the downtime of every restart, the checkpoint
    stalls and the straggler time as measured, the failures the model describes (UNIFORM) at their measured
    rate each losing half the checkpoint interval, the other faults' recompute as measured. None when the run
    trained no step (it hung or crashed before its first): there is nothing to price, and the drill's other
    checks say why it stopped."""
    secs = summary["goodput"]["seconds"]
    if not secs.get("productive"):
        return None
    running = sum(secs.values()) - secs.get("startup", 0.0) - secs.get("shutdown", 0.0)
    uniform = [r for r in rows if r["kind"] in UNIFORM and r["recomputed"] is not None]
    other = sum(r["recomputed"] or 0 for r in rows if r["kind"] not in UNIFORM) * step_s
    every = interval_steps(cfg)
    inp = model.Inputs(
        gpus=1,
        mtbf_hours=secs["productive"] / 3600.0 / max(len(uniform), 1e-9),  # exactly len(uniform) failures
        interval_min=every * step_s / 60.0 if every else None,
        days=secs["productive"] / 86400.0,
    )
    recompute = model.expectation(inp)["recompute_gpu_hours"] * 3600.0 if uniform else 0.0
    paid = secs.get("checkpoint", 0.0) + secs.get("restart", 0.0) + secs.get("straggler", 0.0)
    predicted_running = secs["productive"] + recompute + other + paid
    predicted = secs["productive"] / predicted_running
    measured = secs["productive"] / running
    # n failures at uniform points of an interval lose n/2 intervals give or take sqrt(n/12): a short drill's
    # few failures may miss the expectation by more than 5% by chance alone, and that is no mispricing
    spread = 2 * every * step_s * (len(uniform) / 12) ** 0.5
    return {
        "measured": measured,
        "predicted": predicted,
        "within": abs(measured / predicted - 1) <= GOODPUT_TOLERANCE or abs(running - predicted_running) <= spread,
        "chance_spread_s": spread,
        "uniform_failures": len(uniform),
        "recompute_s": {"measured": secs.get("recompute", 0.0), "model_uniform": recompute, "measured_other": other},
        "recomputed_per_uniform": sum(r["recomputed"] for r in uniform) / len(uniform) if uniform else 0.0,
        "seconds": secs,
    }


def costs(evs: list[dict], summary: dict) -> dict:
    """The measured costs `survival` takes: the stall of a save (the ledger's checkpoint seconds per save) and
    the downtime of a restart (its restart seconds per restart or requeue, detection included)."""
    secs = (summary.get("goodput") or {}).get("seconds", {})
    saves = max(sum(e["event"] == CHECKPOINT_SAVED for e in evs), 1)
    restarts = sum(e["event"] == RESTART or (e["event"] == PREEMPTED and e.get("by") == "supervisor") for e in evs)
    return {
        "stall_s": secs.get("checkpoint", 0.0) / saves,
        "restart_min": secs.get("restart", 0.0) / max(restarts, 1) / 60.0,
    }


def setup(cfg: Config, evs: list[dict], rows: list[dict], run_dir: Path) -> list[str]:
    """What in the setup would waste the most, found by the drill: one line each, what broke and the fix."""
    ck, out = cfg.checkpoint, []
    crashes = [r for r in rows if r["recomputed"] is not None]
    durable = ck.every_steps or ck.every_minutes
    local = ck.local_dir and (ck.local_every_steps or ck.local_every_minutes)
    if not durable and not local:
        lost = sum(r["recomputed"] for r in crashes)
        out.append(
            f"no periodic checkpoint (checkpoint.every_steps and every_minutes are 0): every crash restarts from "
            f"step 0 ({lost} steps recomputed over {len(crashes)} restarts); set checkpoint.every_minutes: auto"
        )
    elif not durable:
        out.append(
            "a fast tier only (checkpoint.local_dir saves, no periodic durable ones): a lost node takes every "
            "checkpoint with it; set checkpoint.every_steps or every_minutes for the durable tier"
        )
    if local and _same_disk(Path(ck.local_dir), run_dir):
        out.append(
            f"fast tier on the same disk as durable ({ck.local_dir} and {run_dir}): a node loss loses both; "
            "put checkpoint.local_dir on the node's own RAM disk or NVMe"
        )
    # (a disk_full fault's failure is the drill's own: trainer.train.loop says "injected" in its message)
    failed = [e for e in evs if e["event"] == CHECKPOINT_FAILED and "(injected" not in e.get("message", "")]
    if failed:
        out.append(
            f"a checkpoint could not be written: {failed[0].get('message', '?')}; the checkpoint directory "
            f"{checkpoint_files.durable_dir(run_dir).parent} needs room for checkpoint.keep_latest "
            f"({ck.keep_latest}) + 1 checkpoints"
        )
    if not cfg.run.compile_cache:
        restarts = [r["productive_s"] for r in crashes if r["productive_s"] is not None]
        mean = sum(restarts) / len(restarts) if restarts else 0.0
        out.append(
            f"restart {mean:.0f} s to a productive step, compiling every time: run.compile_cache is off; point "
            "it at storage every node shares"
        )
    return out


def _same_disk(a: Path, b: Path) -> bool:
    def dev(p: Path) -> int | None:
        for q in (p, *p.parents):
            try:
                return os.stat(q).st_dev
            except OSError:
                continue
        return None

    return dev(a.expanduser()) == dev(b)


def data_and_params(run_dir: Path, ref_dir: Path) -> dict:
    """Exactly-once data (the audit of the drilled run, and its samples step by step against the reference's)
    and the final params hash against the reference's."""
    try:
        rep, stats = audit.check(run_dir, compare=ref_dir if (ref_dir / rundir.AUDIT).is_dir() else None)
        problems = rep.problems
    except FileNotFoundError as e:
        problems, stats = [f"no audit log: {e}"], {}
    mine = run_summary.read(run_dir) or {}
    ref = run_summary.read(ref_dir) or {}
    return {
        "audit_problems": problems,
        "audit": {k: stats.get(k) for k in ("steps", "samples", "sessions", "compared_steps", "skips")},
        "params_sha256": mine.get("params_sha256"),
        "reference_sha256": ref.get("params_sha256"),
        "hash_equal": bool(mine.get("params_sha256")) and mine.get("params_sha256") == ref.get("params_sha256"),
    }


def projection(costs: dict, *, gpus: int, gpu_mtbf_hours: float, days: float, interval_min: float | None) -> dict:
    """The measured costs (stall per save, downtime per restart) at the user's scale, as `survival` takes it."""
    inp = model.Inputs(
        gpus=gpus,
        mtbf_hours=gpu_mtbf_hours,
        interval_min=interval_min,
        days=days,
        stall_s=costs["stall_s"],
        restart_min=costs["restart_min"],
    )
    first, ex = model.expectation(inp), model.exact(inp)
    label, why = model.verdict(first, ex)
    best = model.recommend_interval_min(
        stall_s=inp.stall_s, restart_s=inp.restart_min * 60, gpus=gpus, mtbf_hours=gpu_mtbf_hours
    )
    return {
        "inputs": dataclasses.asdict(inp),
        "expected_failures": first["expected_failures"],
        "wasted_gpu_hours": first["wasted_gpu_hours"],
        "wasted_fraction": first["wasted_fraction"],
        "verdict": f"{label}: {why}",
        "best_interval_min": best,
    }
