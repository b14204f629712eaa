"""#6 GPU check: one prepared script for the GPUs of one host (one H200-class GPU suffices), under 8 minutes.
Runs the ~1B config (one GPU: no FSDP, no remat, scanned layers, cuDNN attention), the ~1B Llama (the same
way, grouped-query attention through cuDNN) and the 124M config under
the supervisor and reports MFU, step time, checkpoint blocking vs bytes / measured device-to-host
bandwidth; `inspect`'s bytes and MFU ceiling for the same 1B run, compiled for the GPU; a bitwise resume
check with `run.deterministic=true` (whose step time, against the 124M run's, prices deterministic ops);
and, with 2 or more GPUs, the 124M config FSDP vs data parallel over all of them.

    python benchmarks/gpu_check.py                 # on the GPU machine; writes benchmarks/results/gpu.json
    python benchmarks/gpu_check.py --cpu-smoke     # the same sequence with tiny models on CPU (minutes)

Bit-exact resume on GPU needs `run.deterministic=true`, which sets XLA_FLAGS=--xla_gpu_deterministic_ops=true
(XLA: "guarantees run-to-run determinism on GPU"; it implies --xla_gpu_exclude_nondeterministic_ops, and
makes scatters, e.g. the embedding gradient, deterministic). Without it, atomics-based reductions may
differ in the last bit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: `python benchmarks/gpu_check.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness, recovery

MFU_TARGET = 0.45
BLOCKING_TARGET = 1.5  # blocking / (state bytes / measured device-to-host bandwidth)
BYTES_PER_PARAM = 12  # fp32 params + AdamW mu and nu (the step and PRNG key are negligible)
CFG = harness.ROOT / "configs"

# name -> (config, overrides, steps, checkpoint every). GPU: the real shapes on one device.
GPU_RUNS = {
    "gpt2-124m": (CFG / "gpt2-124m.yaml", ["log.every_steps=20"], 200, 50),
    # 1B on one 141 GB H200 at 16 x 2048 tokens, no remat (cuDNN flash attention); retried with save_dots.
    "gpt-1b": (
        CFG / "gpt-1b.yaml",
        [
            "mesh.fsdp=1",
            "data.batch_size=16",
            "train.microbatches=1",
            "model.remat=none",
            "log.every_steps=10",
            "checkpoint.keep_latest=1",
        ],
        120,
        40,
    ),
    # The Llama family's ~1B on one GPU the same way: GQA (16 query heads over 4 K/V heads) through cuDNN's
    # fused attention, which takes the K/V heads as they are. Fewer steps: its tokens/s and MFU are the row.
    "llama-1b": (
        CFG / "llama-1b.yaml",
        [
            "mesh.fsdp=1",
            "data.batch_size=16",
            "train.microbatches=1",
            "model.remat=none",
            "log.every_steps=10",
            "checkpoint.keep_latest=1",
        ],
        60,
        30,
    ),
}
SMOKE_MODEL = [
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.seq_len=64",
    "data.batch_size=16",
    "data.default_corpus_mb=1",
    "optim.warmup_steps=5",
]
SMOKE_RUNS = {
    "gpt2-124m": (CFG / "tiny.yaml", SMOKE_MODEL, 20, 5),
    "gpt-1b": (CFG / "tiny.yaml", SMOKE_MODEL + ["model.d_model=128"], 12, 4),
    "llama-1b": (CFG / "llama-tiny.yaml", SMOKE_MODEL, 12, 4),
}
COMMON = ["log.report=false", "checkpoint.every_minutes=0", "supervisor.crash_loop_restarts=1"]


class Budget:
    """The check's time budget, enforced inside every wait: each wait gets the shorter of its own limit and
    the time left, so a part that would overrun is stopped (its process killed) at the budget's end."""

    def __init__(self, seconds: float):
        self.seconds, self.deadline = seconds, time.time() + seconds

    def left(self, cap: float) -> float:
        """Seconds a wait may take: its own limit `cap`, or less when the budget ends sooner."""
        left = self.deadline - time.time()
        if left <= 0:
            raise harness.BenchError(f"time budget of {self.seconds:.0f}s spent")
        return min(cap, left)

    def spent(self) -> bool:
        return time.time() >= self.deadline


def copy_bandwidth(nbytes: int) -> dict:
    """Device-to-host bytes/s the way Orbax copies a state: start every leaf's copy, then collect them."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    n = 16
    elems = nbytes // n // 4

    def fresh():  # new arrays each time: a jax.Array caches its host copy after the first one
        xs = [jnp.full((elems,), i, jnp.float32) for i in range(n)]
        jax.block_until_ready(xs)
        return xs

    def timed() -> float:
        xs = fresh()
        t0 = time.perf_counter()
        for x in xs:
            x.copy_to_host_async()
        for x in xs:
            np.asarray(x)
        return time.perf_counter() - t0

    timed()  # warm-up: staging buffers, first transfer
    best = min(timed() for _ in range(3))
    return {
        "bytes": n * elems * 4,
        "seconds": best,
        "bytes_per_s": n * elems * 4 / best,
        "device": jax.devices()[0].device_kind,
        "platform": jax.default_backend(),
        "devices": jax.device_count(),
    }


def _run_model(
    name: str, spec: tuple, work: Path, cache: Path, bw: float, *, env: dict, retry: list[str], budget: Budget
) -> dict:
    config, overrides, steps, every = spec
    run_dir = work / name
    cmd = harness.trainer_cmd(
        str(config),
        run_dir,
        *overrides,
        *COMMON,
        f"train.steps={steps}",
        f"checkpoint.every_steps={every}",
        f"run.compile_cache={cache}",
    )
    try:
        wall = harness.run(cmd, work / f"{name}.log", timeout=budget.left(420), env=env)
    except harness.BenchError as e:
        if not retry or budget.spent():
            raise
        shutil.rmtree(run_dir, ignore_errors=True)  # e.g. out of memory without remat: retry with it
        cmd += [a for o in retry for a in ("--set", o)]
        wall = harness.run(cmd, work / f"{name}-retry.log", timeout=budget.left(420), env=env)
        overrides = overrides + retry + [f"(first try failed: {str(e).splitlines()[0][:200]})"]
    evs = harness.events(run_dir)
    warm = [e for e in harness.steps(evs) if e["step"] > min(20, steps // 2)]
    n_params = next(e["n_params"] for e in evs if e["event"] == "init")
    blocking = [e["blocking_s"] for e in evs if e["event"] == "checkpoint_saved" and e.get("reason") == "periodic"]
    # A worker's first save also builds Orbax's slicing functions (a one-off per process): steady = the rest.
    steady = harness.median(blocking[1:] or blocking)
    nbytes = n_params * BYTES_PER_PARAM
    out = {
        "overrides": overrides,
        "n_params": n_params,
        "steps": steps,
        "mfu": harness.median([e["mfu"] for e in warm if "mfu" in e]) if any("mfu" in e for e in warm) else None,
        "step_s": harness.median([e["step_s"] for e in warm if not e.get("ckpt_block_s")]),
        "tokens_per_s": harness.median([e["tokens_per_s"] for e in warm if not e.get("ckpt_block_s")]),
        "ckpt_blocking_s": steady,
        "ckpt_blocking_first_s": blocking[0] if blocking else None,
        "state_bytes": nbytes,
        "copy_limit_s": nbytes / bw,
        "blocking_vs_copy_limit": steady / (nbytes / bw),
        "wall_s": wall,
    }
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # a 1B state is ~13 GB: keep the disk free
    return out


def _bitwise(spec: tuple, work: Path, cache: Path, env: dict, smoke: bool, budget: Budget) -> dict:
    """Uninterrupted vs SIGKILLed-and-resumed (supervisor restart, warm cache), deterministic ops on."""
    config, overrides, _, _ = spec
    steps, every = (12, 4) if smoke else (30, 10)
    det_env = env
    base = [
        *overrides,
        *COMMON,
        f"train.steps={steps}",
        f"checkpoint.every_steps={every}",
        f"run.compile_cache={cache}",
        "supervisor.crash_loop_restarts=2",
        "run.deterministic=true",
    ]
    straight = work / "bitwise-straight"
    harness.run(
        harness.trainer_cmd(str(config), straight, *base),
        work / "bitwise-straight.log",
        timeout=budget.left(300),
        env=det_env,
    )
    resumed = work / "bitwise-resumed"
    with harness.Proc(harness.trainer_cmd(str(config), resumed, *base), work / "bitwise-resumed.log", det_env) as p:
        # Killed only once checkpoint `every` is sealed: a kill between Orbax's commit and the seal would
        # resume from scratch, and the check would compare nothing.
        t_kill = recovery.kill_after(p, resumed, every, every + 2, timeout=budget.left(300))
        if p.wait(budget.left(300)) != 0:
            raise harness.BenchError(f"resumed run failed\n{harness.tail(p.log)}")
    a, b = harness.summary(straight), harness.summary(resumed)
    steps_a = harness.steps(harness.events(straight))
    losses_a = {e["step"]: e["loss"] for e in steps_a}
    losses_b = [(e["step"], e["loss"]) for e in harness.steps(harness.events(resumed))]
    out = {
        "run.deterministic": True,
        "params_sha256_straight": a["params_sha256"],
        "params_sha256_resumed": b["params_sha256"],
        "bitwise_equal": a["params_sha256"] == b["params_sha256"] and all(losses_a[s] == v for s, v in losses_b),
        # Against the 124M run's step time: what deterministic ops cost.
        "step_s": harness.median([e["step_s"] for e in steps_a[steps // 2 :] if not e.get("ckpt_block_s")]),
        "restart_warm_cache_s": recovery.split_recovery(harness.events(resumed), t_kill),
    }
    for d in (straight, resumed):
        shutil.rmtree(d / "checkpoints", ignore_errors=True)
    return out


def _inspect(spec: tuple, work: Path, env: dict, smoke: bool, budget: Budget) -> dict:
    """`python -m trainer inspect` of the 1B run as configured above, compiled for this machine's devices."""
    config, overrides, _, _ = spec
    out = work / "inspect_1b.json"
    cmd = [
        sys.executable,
        "-m",
        "trainer",
        "inspect",
        "--config",
        str(config),
        "--json",
        *([] if smoke else ["--devices", "1"]),
        *[a for o in overrides for a in ("--set", o)],
    ]
    with open(out, "w") as fh:
        try:
            code = subprocess.run(
                cmd, cwd=harness.ROOT, stdout=fh, stderr=subprocess.PIPE, text=True, env=env, timeout=budget.left(600)
            )
        except subprocess.TimeoutExpired as e:  # subprocess.run has killed it
            raise harness.BenchError(f"inspect timed out after {e.timeout:.0f}s") from None
    if code.returncode != 0:
        raise harness.BenchError(f"inspect failed: {code.stderr[-2000:]}")
    r = json.loads(out.read_text())
    r["bytes_per_device"]["peak_gib"] = r["bytes_per_device"]["peak"] / (1 << 30)
    return {
        k: r[k]
        for k in (
            "platform",
            "attention",
            "bytes_per_device",
            "collective_bytes_total",
            "flops_per_device_per_step",
            "mfu_ceiling",
        )
    }


def _fsdp_vs_data(spec: tuple, work: Path, cache: Path, env: dict, devices: int, smoke: bool, budget: Budget) -> dict:
    """The 124M config over every device of this host, FSDP vs data parallel (same global batch)."""
    if devices < 2 and not smoke:
        return {"skipped": f"needs 2 or more GPUs, this host has {devices}"}
    config, overrides, _, _ = spec
    n = 8 if smoke else devices
    steps = 12 if smoke else 60
    out = {}
    one = ["mesh.tensor=1"]  # tiny.yaml (the smoke run) has tensor 2
    for name, mesh in (
        ("data", [f"mesh.data={n}", "mesh.fsdp=1", *one]),
        ("fsdp", ["mesh.data=1", f"mesh.fsdp={n}", *one]),
    ):
        run_dir = work / f"parallel-{name}"
        extra = ["mesh.cpu_devices=8"] if smoke else []
        cmd = harness.trainer_cmd(
            str(config),
            run_dir,
            *overrides,
            *COMMON,
            *mesh,
            *extra,
            f"train.steps={steps}",
            "checkpoint.every_steps=0",
            f"data.batch_size={8 * n}",
            f"run.compile_cache={cache}",
        )
        harness.run(cmd, work / f"parallel-{name}.log", timeout=budget.left(420), env=env)
        warm = [e for e in harness.steps(harness.events(run_dir)) if e["step"] > steps // 2]
        out[name] = {
            "tokens_per_s": harness.median([e["tokens_per_s"] for e in warm]),
            "mfu": harness.median([e["mfu"] for e in warm if "mfu" in e]) if "mfu" in warm[0] else None,
        }
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    out["devices"] = n
    out["fsdp_over_data"] = out["fsdp"]["tokens_per_s"] / out["data"]["tokens_per_s"]
    return out


def check(work: Path, *, smoke: bool, budget_s: float) -> dict:
    t0 = time.time()
    budget = Budget(budget_s)
    runs = SMOKE_RUNS if smoke else GPU_RUNS
    env = harness.child_env(XLA_PYTHON_CLIENT_MEM_FRACTION="0.92")
    cache = work / "compile-cache"
    out_bw = work / "copy_bw.json"
    nbytes = (64 << 20) if smoke else (4 << 30)
    harness.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--copy-bw", str(nbytes), str(out_bw)],
        work / "copy_bw.log",
        timeout=budget.left(120),
        env=env,
    )
    bw = json.loads(out_bw.read_text())
    result: dict = {"measured": not smoke, "device": bw["device"], "platform": bw["platform"], "copy": bw}

    def model(name: str, retry: list[str]):
        return lambda: _run_model(name, runs[name], work, cache, bw["bytes_per_s"], env=env, retry=retry, budget=budget)

    # The 1B MFU is the headline: it runs first, so a slow start cannot push it past the budget.
    parts = [
        ("gpt-1b", model("gpt-1b", retry=["model.remat=save_dots"])),
        ("llama-1b", model("llama-1b", retry=["model.remat=save_dots"])),
        ("gpt2-124m", model("gpt2-124m", retry=[])),
        ("bitwise_resume", lambda: _bitwise(runs["gpt2-124m"], work, cache, env, smoke, budget)),
        ("inspect_1b", lambda: _inspect(runs["gpt-1b"], work, env, smoke, budget)),
        ("fsdp_vs_data", lambda: _fsdp_vs_data(runs["gpt2-124m"], work, cache, env, bw["devices"], smoke, budget)),
    ]
    for name, fn in parts:
        if budget.spent():
            result[name] = {"skipped": f"time budget of {budget_s:.0f}s spent"}
            continue
        try:
            result[name] = fn()
        except harness.BenchError as e:
            stopped = f"stopped: time budget of {budget_s:.0f}s spent during this part; " if budget.spent() else ""
            result[name] = {"error": stopped + str(e)[-2000:]}
    det, fast = result.get("bitwise_resume", {}).get("step_s"), result.get("gpt2-124m", {}).get("step_s")
    if det and fast:
        result["deterministic_ops_step_time_ratio"] = det / fast
    result["wall_s"] = time.time() - t0
    result["targets"] = {
        "mfu_1b": f">= {MFU_TARGET}",
        "mfu_llama_1b": f">= {MFU_TARGET}",
        "blocking_vs_copy_limit": f"<= {BLOCKING_TARGET}",
        "bitwise_resume": "equal",
    }
    one_b, small = result.get("gpt-1b", {}), result.get("gpt2-124m", {})
    result["met"] = {
        "mfu_1b": (one_b.get("mfu") or 0) >= MFU_TARGET,
        "mfu_llama_1b": (result.get("llama-1b", {}).get("mfu") or 0) >= MFU_TARGET,
        "blocking_vs_copy_limit": all(r.get("blocking_vs_copy_limit", 99) <= BLOCKING_TARGET for r in (one_b, small)),
        "bitwise_resume": result.get("bitwise_resume", {}).get("bitwise_equal", False),
    }
    return result


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--copy-bw":
        Path(argv[2]).write_text(json.dumps(copy_bandwidth(int(argv[1]))))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny models on CPU: exercises every step of the script")
    p.add_argument("--work", type=Path, default=Path(f"/tmp/trainer-gpu-check-{os.getpid()}"))
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="result JSON (default: benchmarks/results/gpu.json on a GPU, stdout only with --cpu-smoke)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=480.0,
        help="stop the running part (its process killed) and skip the rest once this much time is spent",
    )
    args = p.parse_args(argv)
    if args.cpu_smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
    args.work.mkdir(parents=True, exist_ok=True)
    out = args.out or (None if args.cpu_smoke else harness.ROOT / "benchmarks" / "results" / "gpu.json")
    result = check(args.work, smoke=args.cpu_smoke, budget_s=args.budget_s)
    result["command"] = " ".join(["python", "benchmarks/gpu_check.py", *argv])
    result.update(harness.provenance())
    text = json.dumps(result, indent=1)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
