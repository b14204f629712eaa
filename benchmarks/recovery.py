"""#3 Recovery: SIGKILL the worker from outside (after a durable checkpoint) and time kill -> first
completed step after resume, split into detection, backoff, process start, restore, other setup,
compile (a persistent-cache hit) and first step; against the same run's cold start (empty compilation
cache) -> first step. One supervised tiny run gives the cold start and two recoveries.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from pathlib import Path

from benchmarks import harness
from trainer.store import manifest

TARGET = 0.5


def _first_after(evs: list[dict], t: float, event: str, by_supervisor: bool = False) -> dict:
    for e in evs:
        if e["time"] >= t and e["event"] == event and (("by" in e) == by_supervisor):
            return e
    raise harness.BenchError(f"no {event} event after t={t:.2f}")


def split_cold(evs: list[dict], t_launch: float) -> dict:
    """Launch -> first step event, by phase. Worker-side events carry their own durations."""
    start = _first_after(evs, t_launch, "init")
    return _phases(evs, t_launch, start, {})


def split_recovery(evs: list[dict], t_kill: float) -> dict:
    """Kill -> first step event after resume, by phase."""
    exit_ev = _first_after(evs, t_kill, "worker_exit", by_supervisor=True)
    started = _first_after(evs, exit_ev["time"], "worker_start", by_supervisor=True)
    restore = _first_after(evs, started["time"], "restore")
    out = {"detection": exit_ev["time"] - t_kill, "backoff": started["time"] - exit_ev["time"]}
    return _phases(evs, started["time"], restore, out)


def _phases(evs: list[dict], t0: float, loaded: dict, out: dict) -> dict:
    """From process start t0: until the state is loaded (init or restore: that event's time minus its
    own seconds), the load itself, setup until compile, compile, then the first step event."""
    compiled = _first_after(evs, loaded["time"], "compiled")
    first = _first_after(evs, compiled["time"], "step")
    load_start = loaded["time"] - loaded["seconds"]
    compile_start = compiled["time"] - compiled["seconds"]
    out = dict(out)
    out.update(
        {
            "process_start": load_start - t0,
            loaded["event"]: loaded["seconds"],
            "other_setup": compile_start - loaded["time"],
            "compile": compiled["seconds"],
            "first_step": first["time"] - compiled["time"],
        }
    )
    out["total"] = sum(out.values())
    out["first_step_number"] = first["step"]
    return out


def wait_sealed(run_dir: Path, step: int, *, timeout: float, proc: harness.Proc | None = None) -> Path:
    """Checkpoint `step`'s directory once it is committed (Orbax renamed it into place) and sealed (every
    process's content manifest written, by a thread that runs after the commit). A resume restores only a
    sealed checkpoint: one killed between commit and seal would start from an older one, or from scratch."""
    step_dir = Path(run_dir) / "checkpoints" / str(step)
    harness.wait_for(
        f"checkpoint {step} committed and sealed",
        lambda: step_dir.is_dir() and manifest.sealed(step_dir),
        timeout=timeout,
        proc=proc,
    )
    return step_dir


def kill_after(proc: harness.Proc, run_dir: Path, ckpt_step: int, past: int, *, timeout: float = 600) -> float:
    """SIGKILL the worker once checkpoint `ckpt_step` is sealed and the run is past step `past`; both waits
    together take at most `timeout` seconds."""
    deadline = time.time() + timeout
    wait_sealed(run_dir, ckpt_step, timeout=timeout, proc=proc)
    hb = harness.wait_for(
        f"step {past}",
        lambda: (h := harness.heartbeat(run_dir)) and h["phase"] == "step" and h["step"] >= past and h,
        timeout=max(deadline - time.time(), 0.0),
        proc=proc,
        poll_s=0.01,
    )
    t = time.time()
    os.kill(hb["pid"], signal.SIGKILL)
    return t


def measure(work: Path, cache: Path, quick: bool) -> dict:
    """`cache` is emptied first, so the first start is really cold; it is left warm for the benchmarks
    that run after this one (run_all runs this first)."""
    every = 4 if quick else 8
    kills = [(every, every + 2)] if quick else [(every, every + 2), (2 * every, 2 * every + 2)]
    steps = kills[-1][1] + 4
    shutil.rmtree(cache, ignore_errors=True)
    run_dir = work / "run"
    cmd = harness.trainer_cmd(
        harness.TINY,
        run_dir,
        f"train.steps={steps}",
        f"checkpoint.every_steps={every}",
        f"run.compile_cache={cache}",
        "log.report=false",
    )
    t_kills = []
    with harness.Proc(cmd, work / "run.log") as proc:
        t_launch = proc.t_launch
        for ckpt_step, past in kills:
            t_kills.append(kill_after(proc, run_dir, ckpt_step, past))
        if proc.wait(900) != 0:
            raise harness.BenchError(f"{run_dir}: supervised run failed\n{harness.tail(proc.log)}")
    evs = harness.events(run_dir)
    cold = split_cold(evs, t_launch)
    recoveries = [split_recovery(evs, t) for t in t_kills]
    ratio = harness.median([r["total"] for r in recoveries]) / cold["total"]
    # The supervisor's restart delay is policy (supervisor.backoff_s), not work: the ratio without it.
    delays = [e["backoff_s"] for e in evs if e["event"] == "restart"]
    no_backoff = harness.median([r["total"] - d for r, d in zip(recoveries, delays)]) / cold["total"]
    return {
        "recovery_vs_cold": ratio,
        "target": f"<= {TARGET}",
        "met": ratio <= TARGET,
        "recovery_vs_cold_without_backoff": no_backoff,
        "cold_start_s": cold,
        "recoveries_s": recoveries,
        "setup": f"configs/tiny.yaml supervised, checkpoint every {every} steps, fresh run.compile_cache dir "
        f"(cold = first start with an empty cache; the tokenized corpus is cached per machine); "
        f"worker SIGKILLed from outside {len(kills)}x, each time 2 steps after a committed checkpoint; "
        "supervisor defaults (poll 0.5 s; a failure at a new step restarts at once, "
        "repeats back off from 1 s)",
    }


def main(argv: list[str]) -> int:
    args = harness.cli(__doc__.splitlines()[0], argv)
    harness.emit(args, measure(args.work / "recovery", args.work / "compile-cache", args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
