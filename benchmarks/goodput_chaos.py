"""#5 Goodput under chaos: the tiny config, supervised, with a crash injected every `period` steps; the
goodput the supervisor's ledger measured vs what the run-survival model (trainer.survival.model.expectation)
predicts from the same run's measured checkpoint stall, restart time, step time and failure rate.

Crashes sit half-way between checkpoints (a checkpoint every 20 steps, a crash every 40 starting at
step 30), so each one loses exactly tau/2 of work: the model's expectation for a uniformly random
failure time, made deterministic.
"""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks import harness

TARGET = 0.10  # |measured / predicted - 1|


def _plan(quick: bool) -> tuple[int, int, list[int]]:
    """(checkpoint every, total steps, crash steps)."""
    if quick:
        return 10, 30, [15]
    every, period, steps = 20, 40, 120
    return every, steps, list(range(every + every // 2, steps, period))


def predicted(
    *, productive_s: float, failures: int, every_steps: int, step_s: float, stall_s: float, restart_s: float
) -> dict:
    """The survival model's useful fraction for this run, with gpus=1 and MTBF = productive time / failures."""
    from trainer.survival.model import Inputs, expectation

    inp = Inputs(
        gpus=1,
        mtbf_hours=productive_s / 3600 / max(failures, 1),
        interval_min=every_steps * step_s / 60,
        days=productive_s / 86400,
        stall_s=stall_s,
        restart_min=restart_s / 60,
        mfu=1.0,
    )
    model = expectation(inp)
    return {"inputs": vars(inp), "model": model, "goodput": 1.0 - model["wasted_fraction"]}


def _final_flush(evs: list[dict]) -> float:
    """Seconds from the last step event to the worker's run_complete (the ledger books it as checkpoint)."""
    done = next(e for e in reversed(evs) if e["event"] == "run_complete" and "by" not in e)
    last = max(e["time"] for e in evs if e["event"] == "step" and e["time"] <= done["time"])
    return done["time"] - last


def measure(work: Path, cache: Path, quick: bool) -> dict:
    every, steps, crashes = _plan(quick)
    run_dir = work / "run"
    faults = "[" + ", ".join(f"{{kind: crash, step: {s}}}" for s in crashes) + "]"
    cmd = harness.trainer_cmd(
        harness.TINY,
        run_dir,
        f"train.steps={steps}",
        f"checkpoint.every_steps={every}",
        f"run.compile_cache={cache}",
        "log.report=false",
        f"faults={faults}",
    )
    wall = harness.run(cmd, work / "run.log", timeout=1200)
    s = harness.summary(run_dir)
    secs = s["goodput"]["seconds"]
    evs = harness.events(run_dir)
    stall = harness.median([e["blocking_s"] for e in evs if e["event"] == "checkpoint_saved"])
    restart = sum(s["recoveries_s"]) / len(s["recoveries_s"])
    step_s = secs["productive"] / steps  # mean productive step, checkpoint blocking excluded
    pred = predicted(
        productive_s=secs["productive"],
        failures=s["restarts"],
        every_steps=every,
        step_s=step_s,
        stall_s=stall,
        restart_s=restart,
    )
    # The model knows no one-off first start (cold compile) nor the final flush (waiting for the last save
    # to be durable, the params hash): compare the steady part of the run on both sides.
    final_flush = _final_flush(evs)
    measured = secs["productive"] / (sum(secs.values()) - secs["startup"] - final_flush)
    ratio = measured / pred["goodput"]
    return {
        "goodput_vs_model": ratio,
        "target": f"within {TARGET:.0%} (0.90 .. 1.10)",
        "met": abs(ratio - 1) <= TARGET,
        "measured_goodput": measured,
        "predicted_goodput": pred["goodput"],
        "ledger_goodput_incl_first_start": s["goodput"]["fractions"]["productive"],
        "ledger_seconds": secs,
        "final_flush_s": final_flush,
        "failures": s["restarts"],
        "crash_steps": crashes,
        "stall_s": stall,
        "restart_s": restart,
        "recoveries_s": s["recoveries_s"],
        "step_s": step_s,
        "model": pred,
        "wall_s": wall,
        "setup": f"configs/tiny.yaml supervised, {steps} steps, checkpoint every {every} steps, crash faults at "
        f"steps {crashes}; measured = productive / (wall - first start - final flush); predicted = 1 - "
        "wasted_fraction of trainer.survival.model.expectation(gpus=1, MTBF = productive time / failures, "
        "interval = every_steps x mean step, stall = median checkpoint blocking, restart = mean "
        "recovery from summary.json)",
    }


def main(argv: list[str]) -> int:
    args = harness.cli(__doc__.splitlines()[0], argv)
    harness.emit(args, measure(args.work / "goodput_chaos", args.work / "compile-cache", args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
