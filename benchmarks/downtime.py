"""Downtime per failure, part by part (issue 44): from the failure to the restarted group's first trained step,
split as each restart's `downtime` event splits it (trainer.observe.downtime: noticed, teardown, relaunch,
launch, init, restore, compile, first step), beside the time measured from outside (the kill's moment is known
here; the trainer only estimates it). Every run ends with the params of its undisturbed twin.

1. One machine, tiny config, one process: the worker SIGKILLed 3 times, each once the next attempt's standby
   processes are ready (launch.standby) and the run is 2 steps past a committed checkpoint; beside the same
   with launch.standby=false.
2. Local groups of 2, 4 and 8 processes (micro config, 8 devices in all): one process SIGKILLed; and in the
   2-process group one process frozen (SIGSTOP), default supervisor timeouts (step_timeout_s 120).
3. SLURM on loopback (tests/slurm_cluster.py; root and SLURM's daemons: skipped without them), 3 nodes (2
   train + 1 spare), fast tier every 4 steps, SlurmdTimeout 300 (SLURM's default: what is measured is what the
   trainer notices by itself): the node of process 1 lost whole (every process on it SIGKILLed, its tmpfs
   gone) 5 times; frozen (every process on it SIGSTOPped, slurmd included) 2 times.

    python -m benchmarks.downtime --out benchmarks/results/downtime.json      # ~15 min on 2 cores
"""

from __future__ import annotations

import glob
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness, recovery

ROOT = harness.ROOT
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("TRAINER_TESTS_COMPILE_CACHE", tempfile.mkdtemp(prefix="downtime-jax-cache-"))
from conftest import MICRO  # noqa: E402
from multihost import group_overrides, heartbeat, small_corpus  # noqa: E402

CACHE = os.environ["TRAINER_TESTS_COMPILE_CACHE"]


def _of(run: Path, kind: str) -> list[dict]:
    return [e for e in harness.events(run) if e["event"] == kind]


def _standby_ready(run: Path, processes: int) -> bool:
    return len(glob.glob(str(run / "heartbeat" / "standby-*.ready"))) >= processes


def _recovery(run: Path, t_fail: float) -> dict:
    """The restart after a failure at `t_fail`: measured from outside, and its downtime event."""
    start = next(e for e in _of(run, "worker_start") if e["time"] > t_fail)
    first = next(e for e in _of(run, "step") if e["time"] > start["time"])  # a survivor may log one more before
    down = next(e for e in _of(run, "downtime") if e["time"] >= first["time"] - 1e-3)
    return {
        "failure_to_first_step_s": round(first["time"] - t_fail, 3),
        "accounted_s": down["total_s"],
        "parts_s": down["parts_s"],
        "standby": start.get("standby", ""),
        "first_step_s": round(down["first_step_s"], 3),
    }


def single(work: Path, *, standby: bool, kills: int) -> dict:
    every = 24  # an attempt trains past attempt.STANDBY_AFTER_S (5 s) and its standby's imports before a kill
    steps = every * (kills + 1) + 4
    run = work / ("single-standby" if standby else "single-cold")
    sets = [f"train.steps={steps}", f"checkpoint.every_steps={every}", f"run.compile_cache={CACHE}"]
    sets += ["log.report=false", f"launch.standby={str(standby).lower()}"]
    ref = work / "single-ref"
    if not ref.exists():
        harness.run(harness.trainer_cmd(harness.TINY, ref, *sets), work / "single-ref.log", timeout=600)
    out = []
    with harness.Proc(harness.trainer_cmd(harness.TINY, run, *sets), work / f"{run.name}.log") as proc:
        for k in range(1, kills + 1):
            past = every * k + 2

            recovery.wait_sealed(run, every * k, timeout=300, proc=proc)

            def ready(past=past):
                hb = heartbeat(run, 0)
                at = hb and hb["phase"] == "step" and hb["step"] >= past
                return at and (not standby or _standby_ready(run, 1)) and hb

            hb = harness.wait_for(f"step {past}", ready, timeout=300, proc=proc, poll_s=0.01)
            t = time.time()
            os.kill(hb["pid"], signal.SIGKILL)
            harness.wait_for("the restart's first step", lambda k=k: _of(run, "downtime")[k - 1 :], timeout=120)
            out.append(_recovery(run, t))
        if proc.wait(600) != 0:
            raise harness.BenchError(f"{run}: failed\n{harness.tail(proc.log)}")
    same = harness.summary(run)["params_sha256"] == harness.summary(ref)["params_sha256"]
    return {"recoveries": out, "median_s": harness.median([r["failure_to_first_step_s"] for r in out]), "same": same}


def group(work: Path, corpus: Path, *, processes: int, freeze: bool = False) -> dict:
    """One local group of `processes` (8 devices in all); process 1 SIGKILLed (or SIGSTOPped) at step 14."""
    devices = [f"launch.processes={processes}", f"mesh.cpu_devices={8 // processes}"]
    devices += ["mesh.data=-1", "mesh.tensor=1"] if processes > 4 else []  # a tensor group stays in one process
    run = work / f"group{processes}-{'freeze' if freeze else 'kill'}"
    sets = [*MICRO, *group_overrides(corpus, *devices), "supervisor.backoff_s=1.0"]
    ref = work / f"group{processes}-ref"
    if not ref.exists():
        harness.run(harness.trainer_cmd(harness.TINY, ref, *sets), work / f"{ref.name}.log", timeout=900)
    # Steps slowed (timing only): the failure comes once the standby is ready (attempt.STANDBY_AFTER_S)
    slow = "faults=[{kind: slow, step: 2, seconds: 0.3, count: 60}]"
    with harness.Proc(harness.trainer_cmd(harness.TINY, run, *sets, slow), work / f"{run.name}.log") as proc:
        hb = harness.wait_for(
            "step 14 and the standby ready",
            lambda: (
                (h := heartbeat(run, 1))
                and h["phase"] == "step"
                and h["step"] >= 14
                and _standby_ready(run, processes)
                and h
            ),
            timeout=600,
            proc=proc,
            poll_s=0.01,
        )
        t = time.time()
        os.kill(hb["pid"], signal.SIGSTOP if freeze else signal.SIGKILL)
        if proc.wait(900) != 0:
            raise harness.BenchError(f"{run}: failed\n{harness.tail(proc.log)}")
    out = _recovery(run, t)
    if freeze:
        (hang,) = _of(run, "hang_detected")
        out["named_after_s"] = round(hang["time"] - t, 2)
        out["verdict"] = hang["why"]
    out["same"] = harness.summary(run)["params_sha256"] == harness.summary(ref)["params_sha256"]
    return out


def slurm(work: Path, corpus: Path, *, freeze: bool, runs: int) -> list[dict]:
    from multihost import at_step, job_args, node_of, sbatch_trainer
    from slurm_cluster import freeze_node, local_slurm, lose_node

    out = []
    for i in range(runs):
        w = work / f"slurm-{'freeze' if freeze else 'loss'}{i}"
        run = w / "run"
        args = job_args(
            run,
            corpus,
            "checkpoint.local_dir=/local_scratch/ckpt",
            "checkpoint.local_every_steps=4",
            "launch.processes_per_node=1",
            "faults=[{kind: slow, step: 12, seconds: 0.3, count: 10}]",
        )
        cluster = dict(nodes=3, cpus=2, cred_expire=5, node_local="/local_scratch", node_local_mode="tmpfs")
        with local_slurm(w / "slurm", slurmd_timeout=300, **cluster) as env:
            job, alive = sbatch_trainer(env, nodes=3, per_node=1, out=w / "job.out", args=args)
            victim = at_step(run, 1, 14, alive)
            node = node_of(victim["pid"])
            t = time.time()
            if freeze:
                freeze_node(env, node)
            else:
                lose_node(env, node)
            # The job's end waits for SLURM to notice the lost node (SlurmdTimeout): the run's end is enough.
            harness.wait_for(
                "the run's end", lambda run=run: [e for e in _of(run, "run_complete") if "by" in e], timeout=300
            )
            if freeze:
                lose_node(env, node)  # the frozen processes, ended
        r = _recovery(run, t)
        if freeze:
            hang = next(e for e in _of(run, "hang_detected") if e["time"] > t)
            r.update(named_after_s=round(hang["time"] - t, 2), blamed=hang["node"], frozen=node)
        r["node_suspect"] = [e["node"] for e in _of(run, "node_suspect")]
        r["params_sha256"] = harness.summary(run)["params_sha256"]
        out.append(r)
    return out


def _once(work: Path, name: str, fn):
    """fn()'s result, kept in WORK/NAME.json: a rerun of the benchmark with the same --work skips what it has."""
    path = work / f"{name}.json"
    if path.is_file():
        return json.loads(path.read_text())
    out = fn()
    path.write_text(json.dumps(out))
    return out


def main(argv: list[str]) -> int:
    args = harness.cli(__doc__.splitlines()[0], argv)
    work = args.work
    corpus = small_corpus(work / "corpus")
    kills = 1 if args.quick else 3
    result: dict = {"command": "python -m benchmarks.downtime" + (" --quick" if args.quick else "")}
    result["single_machine"] = {
        "standby": _once(work, "single-standby", lambda: single(work, standby=True, kills=kills)),
        "cold": _once(work, "single-cold", lambda: single(work, standby=False, kills=kills)),
    }
    counts = (2,) if args.quick else (2, 4, 8)
    result["local_groups"] = {
        f"{n}_kill": _once(work, f"group{n}-kill", lambda n=n: group(work, corpus, processes=n)) for n in counts
    }
    result["local_groups"]["2_freeze"] = _once(
        work, "group2-freeze", lambda: group(work, corpus, processes=2, freeze=True)
    )
    from slurm_cluster import slurm_available

    if slurm_available() and os.geteuid() == 0:
        ref = work / "slurm-ref"
        from conftest import run_trainer
        from multihost import TWO

        run_trainer(ref, *group_overrides(corpus, *TWO))
        loss = slurm(work, corpus, freeze=False, runs=1 if args.quick else 5)
        frozen = slurm(work, corpus, freeze=True, runs=1 if args.quick else 2)
        want = harness.summary(ref)["params_sha256"]
        result["slurm_3_nodes"] = {
            "node_lost": loss,
            "node_frozen": frozen,
            "all_equal_to_undisturbed": all(r["params_sha256"] == want for r in loss + frozen),
        }
    result["machine"] = harness.machine()
    harness.emit(args, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
