"""No false verdict from the frozen-process rule (issue 44): clean supervised 2-process runs (micro config,
saves every 2 steps) with a GIL-holding host burst on one process (`hog`, all the time from step 3), slow
durable saves (`slow_save`, 2 s on top of each commit), and whatever load runs beside them (run it beside the
test suite: `python -m pytest -n 4 --dist loadfile tests`, CI's load). Counts the verdicts (hang_detected,
node_suspect, restarts: there must be none) and reports the margin: the largest silence of a live process's
pulse that the supervisor saw (`pulse_gap_s` in each worker_exit) against the 6 s line.

    python -m benchmarks.pulse_margin --out benchmarks/results/pulse_margin.json   # 20 runs, 2 at a time
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import tempfile
from pathlib import Path

from benchmarks import harness

ROOT = harness.ROOT
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("TRAINER_TESTS_COMPILE_CACHE", tempfile.mkdtemp(prefix="pulse-margin-jax-cache-"))
from conftest import MICRO  # noqa: E402
from multihost import TWO, group_overrides, small_corpus  # noqa: E402

from trainer.observe.heartbeat import PULSE_STALE_S  # noqa: E402

FAULTS = "faults=[{kind: hog, step: 3, count: 100, seconds: 0, process: 1}, {kind: slow_save, step: 2, seconds: 2.0}]"


def one(work: Path, corpus: Path, i: int) -> dict:
    run = work / f"run{i}"
    sets = [*MICRO, *group_overrides(corpus, *TWO), "checkpoint.every_steps=2", FAULTS]
    code = harness.Proc(harness.trainer_cmd(harness.TINY, run, *sets), work / f"run{i}.log").wait(900)
    evs = harness.events(run)
    verdicts = [e for e in evs if e["event"] in ("hang_detected", "node_suspect", "restart")]
    gaps = [e["pulse_gap_s"] for e in evs if e["event"] == "worker_exit" and "pulse_gap_s" in e]
    return {"exit": code, "verdicts": verdicts, "pulse_gap_s": max(gaps, default=None)}


def main(argv: list[str]) -> int:
    args = harness.cli(__doc__.splitlines()[0], argv)
    corpus = small_corpus(args.work / "corpus")
    n = 2 if args.quick else 20
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda i: one(args.work, corpus, i), range(n)))
    gaps = [r["pulse_gap_s"] for r in runs if r["pulse_gap_s"] is not None]
    result = {
        "command": "python -m benchmarks.pulse_margin" + (" --quick" if args.quick else ""),
        "runs": n,
        "all_exit_0": all(r["exit"] == 0 for r in runs),
        "verdicts": sum(len(r["verdicts"]) for r in runs),
        "largest_live_pulse_gap_s": max(gaps, default=None),
        "line_s": PULSE_STALE_S,
        "margin_x": round(PULSE_STALE_S / max(gaps), 2) if gaps else None,
        "gaps_s": gaps,
        "details": [r for r in runs if r["verdicts"] or r["exit"]],
        "machine": harness.machine(),
    }
    harness.emit(args, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
