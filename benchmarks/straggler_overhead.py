"""Straggler watch and every-host health: what they cost the step. Two supervised 2-process runs of the tiny
config side by side, one as shipped (each worker times its clean steps into its heartbeat, every process
samples its host's health, the supervisor judges the timings), one with `straggler.enabled=false` and
`log.health=false`; the health sampling made 5x denser than the default (every second) so that its cost, if
any, shows. The two run in alternating slices (SIGSTOP/SIGCONT on each side's whole process tree, as in
benchmarks/step_overhead.py), each timed on its own running time over the same step window.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from benchmarks import harness
from benchmarks.step_overhead import _signal, _tree, _window_done, alternate, running_s

TARGET = 0.99
GROUP = ("launch.processes=2", "mesh.cpu_devices=4", "checkpoint.every_steps=1000", "log.report=false")
WATCHED = ("log.health_every_s=1",)
BARE = ("straggler.enabled=false", "log.health=false")


def _plan(quick: bool) -> tuple[int, int, float, int]:
    """(warm-up steps, measured steps, slice seconds, pairs)."""
    return (5, 10, 1.0, 1) if quick else (20, 60, 2.5, 2)


def _pair(work: Path, cache: Path, warmup: int, n: int, slice_s: float) -> dict:
    runs = {"watched": work / "watched", "bare": work / "bare"}
    overrides = {"watched": WATCHED, "bare": BARE}
    procs, steps = {}, warmup + n + 5
    for side, run_dir in runs.items():
        cmd = harness.trainer_cmd(
            harness.TINY, run_dir, f"train.steps={steps}", f"run.compile_cache={cache}", *GROUP, *overrides[side]
        )
        procs[side] = harness.Proc(cmd, work / f"{side}.log")
        # one at a time to its warm-up step (the first also fills the compile cache), then stopped
        harness.wait_for(
            f"{side} at step {warmup - 3}",
            lambda d=run_dir: (h := harness.heartbeat(d)) and h["phase"] == "step" and h["step"] >= warmup - 3,
            timeout=600,
            proc=procs[side],
            poll_s=0.02,
        )
        _signal(_tree(procs[side]), signal.SIGSTOP)
    try:
        slices = alternate(
            {side: _tree(p) for side, p in procs.items()},
            slice_s,
            until=lambda: all(_window_done(d, warmup + n) for d in runs.values()),
            broken=lambda: any(p.popen.poll() is not None for p in procs.values()),
        )
        for p in procs.values():
            _signal(_tree(p), signal.SIGCONT)  # both finish on their own
        for side, p in procs.items():
            if p.wait(600) != 0:
                raise harness.BenchError(f"{runs[side]}: trainer failed\n{harness.tail(p.log)}")
    finally:
        for p in procs.values():
            p.kill()
    out = {}
    for side, run_dir in runs.items():
        evs = harness.steps(harness.events(run_dir))
        times = [e["time"] for e in evs if warmup <= e["step"] <= warmup + n]
        if len(times) != n + 1 or times[0] < slices[side][0][0]:
            raise harness.BenchError(f"{run_dir}: the window's {n + 1} step events are not all inside the slices")
        out[side] = {"steps": n, "running_s": running_s(times[0], times[-1], slices[side])}
    out["ratio"] = (n / out["watched"]["running_s"]) / (n / out["bare"]["running_s"])
    verdicts = [e for e in harness.events(runs["watched"]) if e["event"] == "straggler"]
    out["straggler_verdicts"] = len(verdicts)
    out["health_processes"] = sorted(
        {e.get("process") for e in harness.events(runs["watched"]) if e["event"] == "health"}
    )
    return out


def measure(work: Path, cache: Path, quick: bool) -> dict:
    warmup, n, slice_s, pairs = _plan(quick)
    runs = [_pair(work / f"pair-{k}", cache, warmup, n, slice_s) for k in range(pairs)]
    watched = sum(r["watched"]["running_s"] for r in runs)
    bare = sum(r["bare"]["running_s"] for r in runs)
    ratio = bare / watched  # the same steps on both sides: the ratio of their rates
    return {
        "straggler_overhead_ratio": ratio,
        "target": f">= {TARGET}",
        "met": ratio >= TARGET,
        "pair_ratios": [r["ratio"] for r in runs],
        "runs": runs,
        "setup": f"configs/tiny.yaml, 2 processes x 4 fake CPU devices, supervised; steps {warmup}-{warmup + n} "
        f"of each side in alternating {slice_s:g} s slices; watched = as shipped with health sampled every 1 s "
        f"on both processes; bare = {' '.join(BARE)}; {len(runs)} pair(s), pooled",
    }


def main(argv: list[str]) -> int:
    args = harness.cli(__doc__.splitlines()[0], argv)
    harness.emit(args, measure(args.work / "straggler_overhead", args.work / "compile-cache", args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
