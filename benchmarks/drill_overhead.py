"""The fire drill's own overhead: what drilling costs the run when nothing fires. A drill of the tiny config
with a mean time between failures so long that no fault is planned (`--mtbf 1e9`), against a plain run of
the same configuration and steps (`python -m trainer` on the config the drill's run was given, the drill's
own changes undone: no data audit). The drilled run and the plain run train side by side in alternating
slices (SIGSTOP/SIGCONT on each side's whole process tree, the drill's own process in its side's; as in
benchmarks/step_overhead.py), each timed on its own running time over the same step window.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from benchmarks import harness
from benchmarks.step_overhead import _signal, _tree, _window_done, alternate, window

TARGET = 0.98
MINUTES = 1.0  # the drill's --minutes: enough steps for the window whatever the step time (it is killed after)


def _plan(quick: bool) -> tuple[int, int, float, int]:
    """(warm-up steps, measured steps, slice seconds, pairs)."""
    return (5, 10, 1.0, 1) if quick else (20, 100, 2.5, 6)


def _at(run_dir: Path, step: int):
    return lambda: (h := harness.heartbeat(run_dir)) and h["phase"] == "step" and h["step"] >= step


def _pair(work: Path, cache: Path, warmup: int, n: int, slice_s: float) -> dict:
    drill_dir = work / "drill"
    runs = {"drilled": drill_dir / "run", "plain": work / "plain"}
    drill = [sys.executable, "-m", "trainer", "drill", "--config", harness.TINY, "--set", f"run.dir={work / 'mine'}"]
    drill += ["--set", f"run.compile_cache={cache}", "--mtbf", "1e9", "--minutes", str(MINUTES)]
    procs = {"drilled": harness.Proc([*drill, "--dir", str(drill_dir)], work / "drill.log")}
    try:
        # the drill calibrates first (filling the compile cache), then starts its run: stopped at its warm-up
        harness.wait_for("the drilled run at its warm-up", _at(runs["drilled"], warmup - 3), timeout=900,
                         proc=procs["drilled"], poll_s=0.02)  # fmt: skip
        _signal(_tree(procs["drilled"]), signal.SIGSTOP)
        log = procs["drilled"].log.read_text()
        if " 0 faults planned" not in log:
            raise harness.BenchError(f"the drill planned faults: {log}")
        # the plain run: the drilled run's config (its steps, so the same compiled program), audit off
        plain = harness.trainer_cmd(str(drill_dir / "run.yaml"), runs["plain"], "data.audit=false")
        procs["plain"] = harness.Proc(plain, work / "plain.log")
        harness.wait_for("the plain run at its warm-up", _at(runs["plain"], warmup - 3), timeout=600,
                         proc=procs["plain"], poll_s=0.02)  # fmt: skip
        _signal(_tree(procs["plain"]), signal.SIGSTOP)
        slices = alternate(
            {side: _tree(p) for side, p in procs.items()},
            slice_s,
            until=lambda: all(_window_done(d, warmup + n) for d in runs.values()),
            broken=lambda: any(p.popen.poll() is not None for p in procs.values()),
            swap=True,
        )
    finally:  # the window is measured: neither side needs to finish (the drill's reference run is not timed)
        for p in procs.values():
            p.kill()
    out = {side: window(run_dir, warmup, n, slices[side]) for side, run_dir in runs.items()}
    out["ratio"] = out["plain"]["running_s"] / out["drilled"]["running_s"]  # drilled tokens/s over plain's
    out["faults_fired"] = (runs["drilled"] / "faults.jsonl").is_file()
    return out


def _parts(work: Path) -> dict:
    """What the drill adds, timed alone in this process: the audit's record of a step's batch (the tiny
    config's), and one poll of process 0's heartbeat by the drill (every trainer.drill.run.POLL_S)."""

    import numpy as np

    from trainer.config import Phase, load_config
    from trainer.drill.run import POLL_S
    from trainer.observe.audit import AuditLog
    from trainer.observe.heartbeat import Heartbeat, heartbeat_path
    from trainer.observe.heartbeat import read as read_heartbeat

    rows = load_config(harness.TINY).data.batch_size
    log = AuditLog(work / "parts", process=0, processes=1, start=0, global_batch=rows, epoch_windows=10**6, skips=[])
    batch = {"ids": np.arange(rows) * 7919, "windows": np.arange(rows) * 104729}
    hb = Heartbeat(work / "parts", 0)
    hb.beat(Phase.STEP, 1)
    return {
        "audit_record_us": harness.per_call(lambda: log.record(1, batch), 2000) * 1e6,
        "heartbeat_poll_us": harness.per_call(lambda: read_heartbeat(heartbeat_path(work / "parts", 0)), 2000) * 1e6,
        "poll_every_s": POLL_S,
    }


def measure(work: Path, cache: Path, quick: bool) -> dict:
    warmup, n, slice_s, pairs = _plan(quick)
    parts = _parts(work)
    runs = [_pair(work / f"pair-{k}", cache, warmup, n, slice_s) for k in range(pairs)]
    drilled = sum(r["drilled"]["running_s"] for r in runs)
    plain = sum(r["plain"]["running_s"] for r in runs)
    ratio = plain / drilled  # the same steps on both sides: the drilled run's tokens/s over the plain run's
    ratios = [r["ratio"] for r in runs]
    step_s = drilled / (n * pairs)
    added = (parts["audit_record_us"] + parts["heartbeat_poll_us"] * step_s / parts["poll_every_s"]) * 1e-6
    return {
        "drill_overhead_ratio": ratio,
        "target": f">= {TARGET}",
        "met": ratio >= TARGET and not any(r["faults_fired"] for r in runs),
        "pair_ratios": ratios,
        "pair_ratio_mean_and_2se": harness.mean_2se(ratios),
        # the cross-check: the parts timed alone, as a ratio on this run's step (one pair's ratio spreads ~2%)
        "parts_ratio": step_s / (step_s + added),
        "parts": parts,
        "step_s": step_s,
        "runs": runs,
        "setup": f"configs/tiny.yaml on 1 process; drilled = `python -m trainer drill --mtbf 1e9 --minutes "
        f"{MINUTES:g}` (0 faults planned: its run has the data audit on and an empty fault list, the drill polling "
        f"its heartbeat every 0.2 s); plain = the drilled run's config with data.audit=false; steps {warmup}-"
        f"{warmup + n} of each in alternating {slice_s:g} s slices; {len(runs)} pair(s), pooled",
    }


def main(argv: list[str]) -> int:
    args = harness.cli(__doc__.splitlines()[0], argv)
    harness.emit(args, measure(args.work / "drill_overhead", args.work / "compile-cache", args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
