"""One command for every benchmark: `python -m benchmarks.run_all` runs each in its own process (each
needs its own jax device setup) and writes benchmarks/results/results.json and results.md with the
machine, the versions and the command that produced them. About 20 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: `python benchmarks/run_all.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness

RESULTS = harness.ROOT / "benchmarks" / "results"
# (result key, module, the key of the earlier result it reads via --input)
# Recovery goes first: it empties the shared compilation cache for a truly cold start and leaves it
# warm for the tiny-config runs after it.
BENCHMARKS = (
    ("recovery", "benchmarks.recovery", None),
    ("step_overhead", "benchmarks.step_overhead", None),
    ("data_headroom", "benchmarks.data_headroom", "step_overhead"),
    ("goodput_chaos", "benchmarks.goodput_chaos", None),
    ("checkpoint_cost", "benchmarks.checkpoint_cost", None),
    ("checkpoint_tiers", "benchmarks.checkpoint_tiers", None),
    ("replica_check", "benchmarks.replica_check", None),
)
# headline key -> (benchmark, target text, what the trainer is compared with)
HEADLINES = {
    "step_overhead_ratio": ("step_overhead", ">= 0.97", "bare jitted loop, same model/batch/mesh, pre-loaded data"),
    "ckpt_blocking_vs_sync": ("checkpoint_cost", "<= 0.05", "synchronous save of the same 101M-param state"),
    "ckpt_throughput_ratio": ("checkpoint_cost", ">= 0.97", "same loop without checkpoints"),
    "local_ckpt_throughput_ratio": (
        "checkpoint_tiers",
        ">= 0.97",
        "same loop without checkpoints; local tier (RAM disk, uncompressed) save per ~10 s window, sealing included",
    ),
    "restore_local_vs_durable": ("checkpoint_tiers", "<= 1", "restore (verify + read) of the durable tier"),
    "replica_check_overhead_at_10": ("replica_check", "<= 0.01", "train step time, tiny config, check every 10"),
    "recovery_vs_cold": ("recovery", "<= 0.5", "cold start (empty compilation cache) to first step"),
    "data_headroom": ("data_headroom", ">= 10", "tokens/s the full trainer consumes"),
    "goodput_vs_model": ("goodput_chaos", "0.90 .. 1.10", "run-survival model fed the run's measured times"),
}


def _run_one(module: str, out: Path, work: Path, *, quick: bool, input_file: Path | None, timeout: float) -> dict:
    cmd = [sys.executable, "-m", module, "--work", str(work), "--out", str(out)]
    cmd += (["--quick"] if quick else []) + (["--input", str(input_file)] if input_file else [])
    load0, t0 = os.getloadavg()[0], time.time()
    try:
        harness.run(cmd, work / f"{module.split('.')[-1]}.log", timeout=timeout)
        result = json.loads(out.read_text())
    except harness.BenchError as e:
        result = {"error": str(e)[-3000:]}
    result["bench_wall_s"] = time.time() - t0
    result["load_avg_1m"] = [round(load0, 2), round(os.getloadavg()[0], 2)]  # neighbours' load, before / after
    return result


def _gpu(work: Path, quick: bool) -> tuple[object, dict | None]:
    """Real GPU check when a GPU is here; else the results of an earlier GPU run, if committed, or
    "not measured" plus the CPU smoke run of the same script."""
    saved = RESULTS / "gpu.json"
    if harness.gpus() and not quick:
        harness.run(
            [sys.executable, "benchmarks/gpu_check.py", "--work", str(work / "gpu"), "--out", str(RESULTS)],
            work / "gpu_check.log",
            timeout=600,
        )
        return json.loads(saved.read_text()), None
    out = work / "gpu-smoke-out" / "gpu.json"
    t0 = time.time()
    try:
        harness.run(
            [
                sys.executable,
                "benchmarks/gpu_check.py",
                "--cpu-smoke",
                "--work",
                str(work / "gpu-smoke"),
                "--out",
                str(out.parent),
            ],
            work / "gpu_smoke.log",
            timeout=600,
        )
        smoke = json.loads(out.read_text())
        errors = [k for k, v in smoke.items() if isinstance(v, dict) and ("error" in v or "skipped" in v)]
        # the preflight of cuDNN's attention fails on a CPU by design (the runs then take XLA's attention)
        errors = [k for k in errors if k != "preflight"]
        smoke_summary = {
            "passed": not errors,
            "failed_parts": errors,
            "wall_s": time.time() - t0,
            "bitwise_equal": smoke.get("bitwise_resume", {}).get("bitwise_equal"),
            "details": smoke,
        }
    except harness.BenchError as e:
        smoke_summary = {"passed": False, "error": str(e)[-2000:], "wall_s": time.time() - t0}
    if saved.is_file() and json.loads(saved.read_text()).get("measured"):
        return json.loads(saved.read_text()), smoke_summary
    return "not measured", smoke_summary


def collect(work: Path, *, quick: bool, only: set[str] | None) -> dict:
    details: dict[str, dict] = {}
    for key, module, needs in BENCHMARKS:
        if only and key not in only:
            continue
        input_file = work / f"{needs}.json" if needs else None
        print(f"[run_all] {key} ...", file=sys.stderr, flush=True)
        details[key] = _run_one(module, work / f"{key}.json", work, quick=quick, input_file=input_file, timeout=900)
        print(f"[run_all] {key}: {details[key].get('bench_wall_s', 0):.0f}s", file=sys.stderr, flush=True)
    out: dict = {k: details.get(bench, {}).get(k) for k, (bench, _, _) in HEADLINES.items()}
    if not only or "gpu" in only:
        print("[run_all] gpu ...", file=sys.stderr, flush=True)
        out["gpu"], smoke = _gpu(work, quick)
        if smoke is not None:
            out["gpu_cpu_smoke"] = smoke
    out["details"] = details
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="few steps each: checks the suite runs (numbers mean little)")
    p.add_argument(
        "--only",
        action="append",
        default=None,
        help=f"run only these (repeatable): {', '.join(k for k, _, _ in BENCHMARKS)}, gpu",
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="where results.json and results.md go")
    p.add_argument("--work", type=Path, default=None, help="scratch dir (default: a tmp dir, removed afterwards)")
    args = p.parse_args(argv)
    work = args.work or Path(f"/tmp/trainer-bench-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    res = collect(work, quick=args.quick, only=set(args.only) if args.only else None)
    res.update(
        command=" ".join(["python -m benchmarks.run_all", *argv]),
        started_utc=started,
        duration_s=round(time.time() - t0, 1),
        quick=args.quick,
        **harness.provenance(),
    )
    from benchmarks import table

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    (args.out / "results.md").write_text(table.render(res, HEADLINES))
    print((args.out / "results.md").read_text())
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
