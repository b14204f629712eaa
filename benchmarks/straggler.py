"""Stragglers: how fast a slow process is named, and that a clean run never names one. 2-process supervised
runs of the tiny config, each process pinned to its own core as on its own host (launch.cpus_per_process=1,
one fake device each, or four), straggler windows of 10 clean steps:

- slowed: from step 30 process 1's host work takes 1.3x, 2x or 3x the step time measured before (the `slow`
  fault's step_multiple), for 40 steps, with one and with four devices a process: the steps from the
  slowdown to the verdict (K), the verdict's slowdown against the run's own (median step while slowed /
  before), when it cleared, and what the rule reads: each process's wait as a share of the step in every
  window (polled from the heartbeats) and how many steps the in-call probe saw run inside the step call.
  The rule's 10% host-bound line must sit between the slowed process's share and its peer's, with room.
- clean: runs with a crash and its restart, periodic saves, evals and a cold compile each (an empty
  compilation cache per run): the straggler verdicts they raised (the target is none).

Run it on a quiet machine: the ~30% case is within the noise of a machine shared with other work.
"""

from __future__ import annotations

import statistics
import sys
import threading
from pathlib import Path

from benchmarks import harness
from trainer.observe.heartbeat import heartbeat_path
from trainer.store.rundir import read_json

PINNED = ("launch.processes=2", "mesh.cpu_devices=1", "mesh.fsdp=1", "mesh.tensor=1", "launch.cpus_per_process=1")
WINDOW, WATCH_GRACE = 10, 3
WATCH = (f"straggler.window_steps={WINDOW}", f"straggler.grace_steps={WATCH_GRACE}", "log.report=false")
SLOW_FROM, SLOW_FOR = 30, 40


def _run(run_dir: Path, cache: Path, *overrides: str, marks: list[dict] | None = None) -> list[dict]:
    """The run's events; `marks`: filled with every process's timing marks as its heartbeats carried them."""
    cmd = harness.trainer_cmd(harness.TINY, run_dir, f"run.compile_cache={cache}", *PINNED, *WATCH, *overrides)
    done = threading.Event()

    def poll() -> None:  # a heartbeat keeps its last 4 marks: read them faster than 4 windows go by
        while not done.wait(0.1):
            for i, seen in enumerate(marks):
                hb = read_json(heartbeat_path(run_dir, i)) or {}
                seen.update({m["n"]: m for m in hb.get("timing") or [] if isinstance(m, dict) and "n" in m})

    poller = threading.Thread(target=poll, daemon=True)
    if marks is not None:
        poller.start()
    try:
        env = harness.child_env(TRAINER_NODE_NAME="host{process}")
        harness.run(cmd, run_dir.parent / f"{run_dir.name}.log", timeout=900, env=env)
    finally:
        done.set()
    return harness.events(run_dir)


def _shares(marks: list[dict]) -> list[dict]:
    """Per window and process: the step (ms), its wait as a share of the step, and the steps run in the call."""
    out = []
    for n in sorted(set(marks[0]).intersection(*marks[1:])):
        if all(n - WINDOW in m for m in marks):
            d = [{k: m[n][k] - m[n - WINDOW][k] for k in ("n", "step_s", "wait_s", "sync")} for m in marks]
            out.append(
                {
                    "n": n,
                    "step_ms": [round(x["step_s"] / x["n"] * 1e3, 1) for x in d],
                    "wait_share": [round(x["wait_s"] / x["step_s"], 3) for x in d],
                    "in_call": [int(x["sync"]) for x in d],
                }
            )
    return out


def slowed(work: Path, multiple: float, devices: int) -> dict:
    fault = f"{{kind: slow, step: {SLOW_FROM}, count: {SLOW_FOR}, step_multiple: {multiple}, process: 1}}"
    steps_n = f"train.steps={SLOW_FROM + SLOW_FOR + 30}"
    marks: list[dict] = [{}, {}]
    mesh = (f"mesh.cpu_devices={devices}", f"mesh.fsdp={devices}")
    run = work / f"slowed-{multiple}-d{devices}"
    evs = _run(run, work / f"cache-d{devices}", steps_n, *mesh, f"faults=[{fault}]", marks=marks)
    windows = _shares(marks)
    # windows wholly inside the slowdown, and wholly before it (mark n: n clean steps, counted after GRACE)
    start = WATCH_GRACE + 1
    slow = [w for w in windows if w["n"] - WINDOW >= SLOW_FROM and w["n"] + start <= SLOW_FROM + SLOW_FOR]
    calm = [w for w in windows if w["n"] + start < SLOW_FROM]
    steps = {e["step"]: e["step_s"] for e in harness.steps(evs)}
    before = statistics.median(steps[s] for s in range(SLOW_FROM - 15, SLOW_FROM - 2))
    during = statistics.median(steps[s] for s in range(SLOW_FROM + 5, SLOW_FROM + SLOW_FOR - 2))
    verdicts = [e for e in evs if e["event"] == "straggler"]
    cleared = [e for e in evs if e["event"] == "straggler_cleared"]
    first = verdicts[0] if verdicts else {}
    return {
        "step_multiple": multiple,
        "devices_per_process": devices,
        "measured_slowdown": during / before,
        "verdicts": [(v["step"], v["process"], v["node"], v["section"], round(v["slowdown"], 3)) for v in verdicts],
        "named_process_1": bool(first) and first["process"] == 1 and first["node"] == "host1",
        "k_steps": first.get("step", 0) - SLOW_FROM if first else None,
        "verdict_slowdown": first.get("slowdown"),
        "cleared_at": [c["step"] for c in cleared],
        "lost_s": sum(e["lost_s"] for e in verdicts + cleared),
        # what the rule reads (the steps are counted from the attempt's start, after GRACE)
        "slowed_wait_share": [w["wait_share"][1] for w in slow],
        "peer_wait_share": [w["wait_share"][0] for w in slow],
        "calm_wait_share": [min(w["wait_share"]) for w in calm],
        "steps_in_call": sum(sum(w["in_call"]) for w in windows),
        "steps_judged": sum(WINDOW * len(w["in_call"]) for w in windows),
        "windows": windows,
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
    cases = [(1.3, 1), (3.0, 4)] if quick else [(m, d) for d in (1, 4) for m in (1.3, 2.0, 3.0)]
    runs = [slowed(work, m, d) for m, d in cases]
    cleans = [clean(work, k) for k in range(2 if quick else 10)]
    # the 10% host-bound line between the shares, with room: the slowed process under half of it, its peer and
    # every calm window's least-waiting process over 5x it
    slowed_max = max(x for r in runs for x in r["slowed_wait_share"])
    others_min = min(x for r in runs for x in r["peer_wait_share"] + r["calm_wait_share"])
    return {
        "slowed": runs,
        "clean_runs": len(cleans),
        "clean_verdicts": sum(len(c["verdicts"]) for c in cleans),
        "clean": cleans,
        "slowed_wait_share_max": slowed_max,
        "peer_and_calm_wait_share_min": others_min,
        "met": all(r["named_process_1"] for r in runs)
        and not any(c["verdicts"] for c in cleans)
        and slowed_max < 0.05
        and others_min > 0.5,
        "setup": "configs/tiny.yaml, 2 supervised processes, each on its own core with one or four fake CPU devices; "
        f"straggler windows of 10 clean steps, 2 in a row, grace 3; slowed: process 1 from step {SLOW_FROM} "
        f"for {SLOW_FOR} steps; clean: 90 steps, a crash (restart), saves every 20, evals every 25, cold compile",
    }


def main(argv: list[str]) -> int:
    args = harness.cli(__doc__.splitlines()[0], argv)
    harness.emit(args, measure(args.work / "straggler", args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
