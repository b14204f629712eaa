"""Stragglers: how fast a slow process is named, and that a clean run never names one. 2-process supervised
runs of the tiny config, each process pinned to its own core as on its own host (launch.cpus_per_process=1,
one fake device each), straggler windows of 10 clean steps:

- slowed: from step 30 process 1's host work takes 1.3x, then (another run) 2.0x the step time measured
  before (the `slow` fault's step_multiple), for 40 steps: the steps from the slowdown to the verdict (K),
  the verdict's slowdown against the run's own (median step while slowed / before), and when it cleared.
- clean: runs with a crash and its restart, periodic saves, evals and a cold compile each (an empty
  compilation cache per run): the straggler verdicts they raised (the target is none).

Run it on a quiet machine: the ~30% case is within the noise of a machine shared with other work.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from benchmarks import harness

PINNED = ("launch.processes=2", "mesh.cpu_devices=1", "mesh.fsdp=1", "mesh.tensor=1", "launch.cpus_per_process=1")
WATCH = ("straggler.window_steps=10", "straggler.grace_steps=3", "log.report=false")
SLOW_FROM, SLOW_FOR = 30, 40


def _run(run_dir: Path, cache: Path, *overrides: str) -> list[dict]:
    cmd = harness.trainer_cmd(harness.TINY, run_dir, f"run.compile_cache={cache}", *PINNED, *WATCH, *overrides)
    harness.run(cmd, run_dir.with_suffix(".log"), timeout=900, env=harness.child_env(TRAINER_NODE_NAME="host{process}"))
    return harness.events(run_dir)


def slowed(work: Path, multiple: float) -> dict:
    fault = f"{{kind: slow, step: {SLOW_FROM}, count: {SLOW_FOR}, step_multiple: {multiple}, process: 1}}"
    steps_n = f"train.steps={SLOW_FROM + SLOW_FOR + 30}"
    evs = _run(work / f"slowed-{multiple}", work / "cache", steps_n, f"faults=[{fault}]")
    steps = {e["step"]: e["step_s"] for e in harness.steps(evs)}
    before = statistics.median(steps[s] for s in range(SLOW_FROM - 15, SLOW_FROM - 2))
    during = statistics.median(steps[s] for s in range(SLOW_FROM + 5, SLOW_FROM + SLOW_FOR - 2))
    verdicts = [e for e in evs if e["event"] == "straggler"]
    cleared = [e for e in evs if e["event"] == "straggler_cleared"]
    first = verdicts[0] if verdicts else {}
    return {
        "step_multiple": multiple,
        "measured_slowdown": during / before,
        "verdicts": [(v["step"], v["process"], v["node"], v["section"], round(v["slowdown"], 3)) for v in verdicts],
        "named_process_1": bool(first) and first["process"] == 1 and first["node"] == "host1",
        "k_steps": first.get("step", 0) - SLOW_FROM if first else None,
        "verdict_slowdown": first.get("slowdown"),
        "cleared_at": [c["step"] for c in cleared],
        "lost_s": sum(e["lost_s"] for e in verdicts + cleared),
    }


def clean(work: Path, k: int) -> dict:
    evs = _run(
        work / f"clean-{k}",
        work / f"cache-clean-{k}",  # empty: each run compiles cold
        "train.steps=90",
        "checkpoint.every_steps=20",
        "eval.every_steps=25",
        f"faults=[{{kind: crash, step: {37 + k}, process: {k % 2}}}]",
    )
    return {
        "restarts": sum(e["event"] == "restart" for e in evs),
        "saves": sum(e["event"] == "checkpoint_saved" for e in evs),
        "evals": sum(e["event"] == "eval" for e in evs),
        "verdicts": [e for e in evs if e["event"] == "straggler"],
    }


def measure(work: Path, quick: bool) -> dict:
    runs = [slowed(work, m) for m in (1.3, 2.0)]
    cleans = [clean(work, k) for k in range(2 if quick else 10)]
    return {
        "slowed": runs,
        "clean_runs": len(cleans),
        "clean_verdicts": sum(len(c["verdicts"]) for c in cleans),
        "clean": cleans,
        "met": all(r["named_process_1"] for r in runs) and not any(c["verdicts"] for c in cleans),
        "setup": "configs/tiny.yaml, 2 supervised processes, each on its own core with one fake CPU device; "
        f"straggler windows of 10 clean steps, 2 in a row, grace 3; slowed: process 1 from step {SLOW_FROM} "
        f"for {SLOW_FOR} steps; clean: 90 steps, a crash (restart), saves every 20, evals every 25, cold compile",
    }


def main(argv: list[str]) -> int:
    args = harness.cli(__doc__.splitlines()[0], argv)
    harness.emit(args, measure(args.work / "straggler", args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
