"""Straggler watch and every-host health: what they cost the step. Two supervised 2-process runs of the tiny
config side by side, one as shipped (each worker times its clean steps into its heartbeat, every process
samples its host's health every `log.health_every_s`, the supervisor judges the timings), one with
`straggler.enabled=false` and `log.health=false` (no health thread, no alert monitors). The two run in
alternating slices (SIGSTOP/SIGCONT on each side's whole process tree, as in benchmarks/step_overhead.py),
each timed on its own running time over the same step window.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from benchmarks import harness
from benchmarks.step_overhead import _signal, _tree, _window_done, alternate, window

TARGET = 0.99
GROUP = ("launch.processes=2", "mesh.cpu_devices=4", "checkpoint.every_steps=1000", "log.report=false")
WATCHED = ()
BARE = ("straggler.enabled=false", "log.health=false")


def _plan(quick: bool) -> tuple[int, int, float, int]:
    """(warm-up steps, measured steps, slice seconds, pairs)."""
    # 12 pairs: one pair's ratio spreads ~1.5-2% (an A/A control of two identical sides read 0.961 and 0.990),
    # so 4 pairs could not tell 0.99 from 0.975; 12 bring the pooled ratio's standard error to ~0.5%.
    return (5, 10, 1.0, 1) if quick else (20, 60, 2.5, 12)


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
            swap=True,
        )
        for p in procs.values():
            _signal(_tree(p), signal.SIGCONT)  # both finish on their own
        for side, p in procs.items():
            if p.wait(600) != 0:
                raise harness.BenchError(f"{runs[side]}: trainer failed\n{harness.tail(p.log)}")
    finally:
        for p in procs.values():
            p.kill()
    out = {side: window(run_dir, warmup, n, slices[side]) for side, run_dir in runs.items()}
    out["ratio"] = (n / out["watched"]["running_s"]) / (n / out["bare"]["running_s"])
    verdicts = [e for e in harness.events(runs["watched"]) if e["event"] == "straggler"]
    out["straggler_verdicts"] = len(verdicts)
    out["health_processes"] = sorted(
        {e.get("process") for e in harness.events(runs["watched"]) if e["event"] == "health"}
    )
    return out


def _parts(work: Path) -> dict:
    """The two additions timed alone, in this process: a heartbeat carrying the timing against one without
    (the per-step cost: the counters themselves are a few additions), and one host health sample (every
    log.health_every_s, in its own thread)."""

    from trainer.config import LogConfig, Phase
    from trainer.observe import health
    from trainer.observe.heartbeat import Heartbeat
    from trainer.train.step_log import MARKS

    hb = Heartbeat(work / "parts", 0)
    plain = harness.per_call(lambda: hb.beat(Phase.STEP, 1), 2000)
    mark = dict(n=1000, step_s=123.4, wait_s=100.1, data_s=2.3, dispatch_s=0.0, sync=1000)
    hb.timing = [dict(mark, n=mark["n"] + 20 * k) for k in range(MARKS)]  # as many window marks as it ever carries
    timed = harness.per_call(lambda: hb.beat(Phase.STEP, 1), 2000)
    collector = health.HealthCollector(every_s=LogConfig.health_every_s, sources=[health.HostSource()])
    sample = harness.per_call(collector.sample, 200)
    return {
        "heartbeat_with_timing_extra_us": (timed - plain) * 1e6,
        "health_sample_ms": sample * 1e3,
        "health_every_s": LogConfig.health_every_s,
    }


def measure(work: Path, cache: Path, quick: bool) -> dict:
    warmup, n, slice_s, pairs = _plan(quick)
    parts = _parts(work)
    runs = [_pair(work / f"pair-{k}", cache, warmup, n, slice_s) for k in range(pairs)]
    watched = sum(r["watched"]["running_s"] for r in runs)
    bare = sum(r["bare"]["running_s"] for r in runs)
    ratio = bare / watched  # the same steps on both sides: the ratio of their rates
    step_s = watched / (n * pairs)
    # what the parts cost a step of this run: the extra heartbeat bytes every step, a health sample's share
    added = max(parts["heartbeat_with_timing_extra_us"], 0.0) * 1e-6
    added += parts["health_sample_ms"] * 1e-3 * step_s / parts["health_every_s"]
    return {
        "straggler_overhead_ratio": ratio,
        "target": f">= {TARGET}",
        "met": ratio >= TARGET,
        "pair_ratios": [r["ratio"] for r in runs],
        "pair_ratio_mean_and_2se": harness.mean_2se([r["ratio"] for r in runs]),
        # the cross-check: the parts timed alone, as a ratio on this run's step (the pairs' spread is ~1-2%)
        "parts_ratio": step_s / (step_s + added),
        "parts": parts,
        "step_s": step_s,
        "runs": runs,
        "setup": f"configs/tiny.yaml, 2 processes x 4 fake CPU devices, supervised; steps {warmup}-{warmup + n} "
        f"of each side in alternating {slice_s:g} s slices; watched = as shipped (health sampled every 5 s on "
        f"both processes); bare = {' '.join(BARE)}; {len(runs)} pair(s), pooled",
    }


def main(argv: list[str]) -> int:
    args = harness.cli(__doc__.splitlines()[0], argv)
    harness.emit(args, measure(args.work / "straggler_overhead", args.work / "compile-cache", args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
