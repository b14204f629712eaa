"""GPU check (issue 47): one prepared script for one GPU that cannot come back empty, under 8 minutes.

Device: nvidia-h200 (one H200, ~139 GiB). The ~1B runs go without remat at 16 x 2048 tokens; on an H100's
~78 GiB gpt-1b may not fit, and then its retry with `model.remat=save_dots` is what runs (the row says so).
The GPU machine's image has jax, flax, optax and orbax but not grain, array_record, portpicker or
tensorboardX: they travel as wheels. Here, once (benchmarks/README.md, "GPU"):

    python benchmarks/wheelhouse.py      # .whl/ (git-ignored): every wheel the GPU machine lacks

then the device tool's `run` with kind "nvidia-h200", carry [".whl"], timeout_s 600 and this command:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    && PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out $OUT

(one line). The results come back from $OUT: gpu.json, rewritten after every part, so a part that ran is never
lost to a later one's failure or to the call's time limit, and gpu_logs.txt, the tail of every part's logs.
Commit both under benchmarks/results/.

In this order, each part under its own budget (`PART_S`, seconds; `--part-s NAME=S` changes one), all inside
`--budget-s` (480 s): a part that would overrun is stopped, its process killed, and what is left is skipped.

    preflight       ~20 s: a tiny jitted causal cuDNN attention, forward and backward in bf16, against XLA's,
                    in a subprocess with a timeout. If it fails or hangs, every run after it gets
                    model.attention=xla (xla_remat for the ~1B models: no L x L scores kept), and the JSON
                    says so and why; each run's own `compiled` event says which attention its step ran.
    copy_bw         device-to-host bandwidth, measured the way Orbax copies (the checkpoint's copy limit)
    gpt2-124m       configs/gpt2-124m.yaml: MFU (target >= 0.40), step time, checkpoint blocking vs the limit
    gpt-1b          configs/gpt-1b.yaml on one GPU (no FSDP, no remat, batch 16 x 2048): MFU (>= 0.50)
    llama-1b        configs/llama-1b.yaml the same way (GQA through cuDNN): MFU (>= 0.50)
    bitwise_resume  124M with run.deterministic=true, straight vs SIGKILLed and resumed: equal params and losses
    inspect_1b      `python -m trainer inspect` of the 1B run compiled for the GPU
    fsdp_vs_data    with 2 or more GPUs only: the 124M over all of them, FSDP vs data parallel
    ab_*            only when the budget has time left after the above: the GPU choices of trainer/xla_env.py
                    and the model measured against the runs above: the latency-hiding scheduler on (124M),
                    layers unrolled (124M), the fallback remat policy (1B, `--fallback-remat`), and jax's
                    default memory fraction (1B: does it fit at 0.75 instead of 0.92?)

    python benchmarks/gpu_check.py --cpu-smoke     # the same sequence with tiny models on CPU (minutes)

MFU is read from the trainer's step events: `mfu` counts attention's causal half (llm.c's and MaxText's
convention, the targets' convention), `mfu_full_attn`, where present, the whole L x L (the figure logged
before); the JSON keeps both and says which `mfu` is. Bit-exact resume on GPU needs `run.deterministic=true`
(trainer/xla_env.py: XLA's deterministic ops); its step time over the 124M run's prices it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: `python benchmarks/gpu_check.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness, recovery

DEVICE_KIND = "nvidia-h200"  # the device tool's kind this check needs (gpt-1b without remat; see above)
MFU_TARGET_124M = 0.40  # llm.c reaches ~40% for GPT-2 124M on one H100
MFU_TARGET_1B = 0.50  # MPT-1B and OLMo-core 1B report 40-46%
BLOCKING_TARGET = 1.5  # blocking / (state bytes / measured device-to-host bandwidth)
BYTES_PER_PARAM = 12  # fp32 params + AdamW mu and nu (the step and PRNG key are negligible)
TOTAL_S = 480.0  # the device lends 15 minutes a session, the machine's start included
SMOKE_TOTAL_S = 1200.0
MEM_FRACTION = 0.92  # of the GPU's memory for jax (run.gpu_mem_fraction): the ~1B without remat needs it
FALLBACK_REMAT = "save_dots"  # the ~1B's retry when it does not fit without remat
CFG = harness.ROOT / "configs"
PREFLIGHT_CASES = ((1024, 12, 12, 64), (2048, 16, 4, 128))  # (L, query heads, K/V heads, head dim): 124M, ~1B GQA

# name -> its own budget on a GPU, seconds; in the order they run. A/B parts (ab_*) run only when the whole
# budget still has their own left. The main parts add up to TOTAL_S.
PART_S = {
    "preflight": 25,
    "copy_bw": 20,
    "gpt2-124m": 90,
    "gpt-1b": 130,
    "llama-1b": 85,
    "bitwise_resume": 75,
    "inspect_1b": 55,
    "fsdp_vs_data": 120,
    "ab_latency_hiding_124m": 60,
    "ab_unrolled_124m": 75,
    "ab_fallback_remat_1b": 110,
    "ab_default_mem_fraction_1b": 100,
}
SMOKE_PART_S = 240  # every part's own budget with --cpu-smoke (2 shared cores)


@dataclass(frozen=True)
class Run:
    config: Path
    overrides: tuple[str, ...]
    steps: int
    every: int  # checkpoint every; 0: none but the final save
    attention_fallback: str = "xla"  # the XLA path this model takes when cuDNN's attention fails


ONE_GPU = ("mesh.fsdp=1", "data.batch_size=16", "train.microbatches=1", "model.remat=none", "checkpoint.keep_latest=1")
# name -> the run. GPU: the real shapes on one device. The ~1B ones fall back to xla_remat: XLA's attention
# keeping its L x L scores would need ~77 GB at 16 x 2048.
GPU_RUNS = {
    "gpt2-124m": Run(CFG / "gpt2-124m.yaml", ("log.every_steps=10",), 150, 50),
    "gpt-1b": Run(CFG / "gpt-1b.yaml", (*ONE_GPU, "log.every_steps=10"), 60, 20, "xla_remat"),
    "llama-1b": Run(CFG / "llama-1b.yaml", (*ONE_GPU, "log.every_steps=10"), 40, 20, "xla_remat"),
}
SMOKE_MODEL = (
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.seq_len=64",
    "data.batch_size=16",
    "data.default_corpus_mb=1",
    "optim.warmup_steps=5",
)
SMOKE_RUNS = {
    "gpt2-124m": Run(CFG / "tiny.yaml", SMOKE_MODEL, 20, 5),
    "gpt-1b": Run(CFG / "tiny.yaml", (*SMOKE_MODEL, "model.d_model=128"), 12, 4, "xla_remat"),
    "llama-1b": Run(CFG / "llama-tiny.yaml", SMOKE_MODEL, 12, 4, "xla_remat"),
}
COMMON = ("log.report=false", "checkpoint.every_minutes=0", "supervisor.crash_loop_restarts=1")
# A failed first try that names cuDNN's attention is retried with the model's XLA attention path.
CUDNN_FAILURE = ("cudnn", "CUDNN", "cuDNN", "cuda_dnn", "fmha", "fused_attention", "dot_product_attention")
OUT_OF_MEMORY = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM")


class Budget:
    """A time budget, enforced inside every wait: each wait gets the shorter of its own limit and the time left,
    so a part that would overrun is stopped (its process killed) at the budget's end. `label` names it in
    messages ("time budget of 480s")."""

    def __init__(self, seconds: float, label: str):
        self.label, self.deadline = label, time.time() + seconds

    def left(self, cap: float = float("inf")) -> float:
        """Seconds a wait may take: its own limit `cap`, or less when the budget ends sooner."""
        left = self.deadline - time.time()
        if left <= 0:
            raise harness.BenchError(f"{self.label} spent")
        return min(cap, left)

    def remaining(self) -> float:
        return self.deadline - time.time()

    def spent(self) -> bool:
        return time.time() >= self.deadline


@dataclass
class Check:
    """What the parts share: where they write, the runs, what the preflight decided."""

    work: Path
    smoke: bool
    runs: dict[str, Run]
    env: dict[str, str]
    fallback_remat: str
    cache: Path = field(init=False)
    forced_attention: str = ""  # why every later run takes XLA's attention ("" = auto: cuDNN on a GPU in bf16)
    bw: float = 0.0  # device-to-host bytes/s (copy_bw)
    devices: int = 1
    results: dict = field(default_factory=dict)

    def __post_init__(self):
        self.cache = self.work / "compile-cache"

    def attention_sets(self, run: Run) -> list[str]:
        return [f"model.attention={run.attention_fallback}"] if self.forced_attention else []

    def common(self) -> list[str]:
        return [*COMMON, f"run.compile_cache={self.cache}", f"run.gpu_mem_fraction={MEM_FRACTION}"]


# --- the subprocess probes ------------------------------------------------------------------------------------


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


def _attention_grads(impl: str):
    """jit(value_and_grad) of a loss of jax's causal attention through `impl` (cudnn | xla)."""
    import jax
    import jax.numpy as jnp

    def loss(q, k, v):
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
        return jnp.mean(jnp.square(o.astype(jnp.float32)))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def attention_preflight() -> dict:
    """cuDNN's fused causal attention, jitted, forward and backward in bf16 at the head shapes of the runs
    below (tiny batch), checked against XLA's attention. Raises if it fails or disagrees."""
    import jax
    import jax.numpy as jnp

    out = {"platform": jax.default_backend(), "device": jax.devices()[0].device_kind, "cases": []}
    for length, heads, kv_heads, dim in PREFLIGHT_CASES:
        keys = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(keys[0], (1, length, heads, dim), jnp.bfloat16)
        k, v = (jax.random.normal(r, (1, length, kv_heads, dim), jnp.bfloat16) for r in keys[1:])

        t0 = time.perf_counter()
        got = jax.block_until_ready(_attention_grads("cudnn")(q, k, v))
        seconds = time.perf_counter() - t0
        want = _attention_grads("xla")(q, k, v)
        flat = lambda r: [r[0], *r[1]]  # noqa: E731
        err = max(
            float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
            / (float(jnp.max(jnp.abs(b.astype(jnp.float32)))) + 1e-6)
            for a, b in zip(flat(got), flat(want))
        )
        case = {"L": length, "heads": heads, "kv_heads": kv_heads, "head_dim": dim, "seconds": seconds, "rel_err": err}
        out["cases"].append(case)
        if not err < 0.05:  # bf16 rounding is ~1e-2 at most; NaN fails too
            raise RuntimeError(f"cuDNN attention disagrees with XLA's: {case}")
    return out


# --- the parts --------------------------------------------------------------------------------------------------


def _probe(c: Check, name: str, args: list[str], budget: Budget) -> dict:
    out = c.work / f"{name}.json"
    out.unlink(missing_ok=True)
    harness.run(
        [sys.executable, "-m", "benchmarks.gpu_check", *args, str(out)],
        c.work / f"{name}.log",
        timeout=budget.left(),
        env=c.env,
    )
    return json.loads(out.read_text())


def part_preflight(c: Check, budget: Budget) -> dict:
    try:
        r = _probe(c, "preflight", ["--preflight"], budget)
        return {"ok": True, **r, "attention": "auto (cuDNN on a GPU in bf16)"}
    except harness.BenchError as e:
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        why = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else str(e))
        if lines and "timed out" in lines[0]:
            why = lines[0]
        c.forced_attention = f"cuDNN attention preflight failed: {why.strip()[:300]}"
        return {
            "ok": False,
            "error": str(e)[-1500:],
            "attention": "xla (model.attention=xla, or xla_remat for the ~1B models, on every run after this)",
            "why": c.forced_attention,
        }


def part_copy_bw(c: Check, budget: Budget) -> dict:
    r = _probe(c, "copy_bw", ["--copy-bw", str((64 << 20) if c.smoke else (1 << 30))], budget)
    c.bw, c.devices = r["bytes_per_s"], r["devices"]
    c.results.update(device=r["device"], platform=r["platform"])
    return r


def _mfu(warm: list[dict], key: str) -> float | None:
    vals = [e[key] for e in warm if e.get(key) is not None]
    return harness.median(vals) if vals else None


def _measure(c: Check, name: str, run: Run, extra: list[str], budget: Budget, *, retry: list[str]) -> dict:
    """One supervised run of `run` (+ `extra`), retried once on failure: with XLA's attention when the failure
    names cuDNN's (and every later run with it), else with `retry` (e.g. remat), if the budget has time left."""
    run_dir = c.work / name
    sets = [*run.overrides, *c.common(), *extra, f"train.steps={run.steps}", f"checkpoint.every_steps={run.every}"]
    note = []
    try:
        wall = harness.run(
            harness.trainer_cmd(str(run.config), run_dir, *sets, *c.attention_sets(run)),
            c.work / f"{name}.log",
            timeout=budget.left(),
            env=c.env,
        )
    except harness.BenchError as e:
        said = _keep_worker_logs(run_dir, c.work, name) + (c.work / f"{name}.log").read_text(errors="replace")
        oom = any(w in said for w in OUT_OF_MEMORY)  # an OOM names cuDNN's kernels too: remat, not XLA attention
        cudnn = not oom and not c.forced_attention and any(w in said for w in CUDNN_FAILURE)
        if budget.spent() or not (cudnn or retry):
            raise
        if cudnn:
            c.forced_attention = f"{name} failed in cuDNN's attention: {str(e).splitlines()[-1][:300]}"
        else:
            sets += retry
        note = [f"(first try failed: {str(e).splitlines()[0][:200]}; retried with {c.forced_attention or retry})"]
        shutil.rmtree(run_dir, ignore_errors=True)
        wall = harness.run(
            harness.trainer_cmd(str(run.config), run_dir, *sets, *c.attention_sets(run)),
            c.work / f"{name}-retry.log",
            timeout=budget.left(),
            env=c.env,
        )
    _keep_worker_logs(run_dir, c.work, name)
    evs = harness.events(run_dir)
    compiled = next(e for e in evs if e["event"] == "compiled")
    warm = [e for e in harness.steps(evs) if e["step"] > min(20, run.steps // 2)]
    calm = [e for e in warm if not e.get("ckpt_block_s")]
    n_params = next(e["n_params"] for e in evs if e["event"] == "init")
    out = {
        "overrides": [*run.overrides, *extra, *c.attention_sets(run), *note],
        "attention": compiled.get("attention"),  # what the step ran, as the trainer resolved it
        "device_kind": compiled.get("device_kind"),
        "xla_flags": compiled.get("xla_flags"),
        "gpu_mem_fraction": compiled.get("gpu_mem_fraction"),
        "compile_s": compiled.get("seconds"),
        "n_params": n_params,
        "steps": run.steps,
        "mfu": _mfu(warm, "mfu"),
        "mfu_full_attn": _mfu(warm, "mfu_full_attn"),
        "mfu_convention": "causal half" if any("mfu_full_attn" in e for e in warm) else "full L x L (older trainer)",
        "step_s": harness.median([e["step_s"] for e in calm]),
        "tokens_per_s": harness.median([e["tokens_per_s"] for e in calm]),
        "wall_s": wall,
    }
    blocking = [e["blocking_s"] for e in evs if e["event"] == "checkpoint_saved" and e.get("reason") == "periodic"]
    if blocking and c.bw:
        # A worker's first save also builds Orbax's slicing functions (a one-off per process): steady = the rest.
        steady = harness.median(blocking[1:] or blocking)
        nbytes = n_params * BYTES_PER_PARAM
        out.update(
            ckpt_blocking_s=steady,
            ckpt_blocking_first_s=blocking[0],
            state_bytes=nbytes,
            copy_limit_s=nbytes / c.bw,
            blocking_vs_copy_limit=steady / (nbytes / c.bw),
        )
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # a 1B state is ~13 GB: keep the disk free
    return out


def _keep_worker_logs(run_dir: Path, work: Path, name: str) -> str:
    """Copy the run's worker logs (library output too, which the supervisor keeps off its own) beside the
    part's log, where the record reads its tails; their text."""
    text = ""
    for log in sorted((run_dir / "logs").glob("worker-*.log")):
        shutil.copyfile(log, work / f"{name}-{log.name}")
        text += log.read_text(errors="replace")
    return text


def part_model(name: str, retry: list[str]) -> Callable[[Check, Budget], dict]:
    return lambda c, budget: _measure(c, name, c.runs[name], [], budget, retry=retry)


def part_bitwise(c: Check, budget: Budget) -> dict:
    """Uninterrupted vs SIGKILLed-and-resumed (supervisor restart, warm cache), deterministic ops on."""
    run = c.runs["gpt2-124m"]
    steps, every = (12, 4) if c.smoke else (30, 10)
    base = [
        *run.overrides,
        *c.attention_sets(run),
        *c.common(),
        f"train.steps={steps}",
        f"checkpoint.every_steps={every}",
        "supervisor.crash_loop_restarts=2",
        "run.deterministic=true",
    ]
    straight, resumed = c.work / "bitwise-straight", c.work / "bitwise-resumed"
    cmd = lambda d: harness.trainer_cmd(str(run.config), d, *base)  # noqa: E731
    harness.run(cmd(straight), c.work / "bitwise_resume-straight.log", timeout=budget.left(), env=c.env)
    with harness.Proc(cmd(resumed), c.work / "bitwise_resume-resumed.log", c.env) as p:
        # Killed only once checkpoint `every` is sealed: a kill between Orbax's commit and the seal would
        # resume from scratch, and the check would compare nothing.
        t_kill = recovery.kill_after(p, resumed, every, every + 2, timeout=budget.left())
        if p.wait(budget.left()) != 0:
            raise harness.BenchError(f"resumed run failed\n{harness.tail(p.log)}")
    a, b = harness.summary(straight), harness.summary(resumed)
    steps_a = harness.steps(harness.events(straight))
    losses_a = {e["step"]: e["loss"] for e in steps_a}
    losses_b = [(e["step"], e["loss"]) for e in harness.steps(harness.events(resumed))]
    compiled = next(e for e in harness.events(straight) if e["event"] == "compiled")
    out = {
        "run.deterministic": True,
        "xla_flags": compiled.get("xla_flags"),
        "attention": compiled.get("attention"),
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


def part_inspect(c: Check, budget: Budget) -> dict:
    """`python -m trainer inspect` of the 1B run as configured above, compiled for this machine's devices."""
    run = c.runs["gpt-1b"]
    out, log = c.work / "inspect_1b.json", c.work / "inspect_1b.log"
    cmd = [
        sys.executable,
        "-m",
        "trainer",
        "inspect",
        "--config",
        str(run.config),
        "--json",
        *([] if c.smoke else ["--devices", "1"]),
        *[a for o in (*run.overrides, *c.attention_sets(run)) for a in ("--set", o)],
    ]
    with open(out, "w") as fh, open(log, "w") as err:
        try:
            code = subprocess.run(
                cmd, cwd=harness.ROOT, stdout=fh, stderr=err, text=True, env=c.env, timeout=budget.left()
            )
        except subprocess.TimeoutExpired as e:  # subprocess.run has killed it
            raise harness.BenchError(f"inspect timed out after {e.timeout:.0f}s\n{harness.tail(log)}") from None
    if code.returncode != 0:
        raise harness.BenchError(f"inspect failed:\n{harness.tail(log, 30)}")
    r = json.loads(out.read_text())
    r["bytes_per_device"]["peak_gib"] = r["bytes_per_device"]["peak"] / (1 << 30)
    keys = ("platform", "attention", "bytes_per_device", "collective_bytes_total", "flops_per_device_per_step")
    return {k: r.get(k) for k in (*keys, "mfu_ceiling")}


def part_fsdp_vs_data(c: Check, budget: Budget) -> dict:
    """The 124M config over every device of this host, FSDP vs data parallel (same global batch)."""
    if c.devices < 2 and not c.smoke:
        return {"skipped": f"needs 2 or more GPUs, this host has {c.devices}"}
    run = c.runs["gpt2-124m"]
    n = 8 if c.smoke else c.devices
    steps = 12 if c.smoke else 60
    out = {}
    one = ["mesh.tensor=1"]  # tiny.yaml (the smoke run) has tensor 2
    for name, mesh in (
        ("data", [f"mesh.data={n}", "mesh.fsdp=1", *one]),
        ("fsdp", ["mesh.data=1", f"mesh.fsdp={n}", *one]),
    ):
        run_dir = c.work / f"parallel-{name}"
        extra = ["mesh.cpu_devices=8"] if c.smoke else []
        cmd = harness.trainer_cmd(
            str(run.config),
            run_dir,
            *run.overrides,
            *c.attention_sets(run),
            *c.common(),
            *mesh,
            *extra,
            f"train.steps={steps}",
            "checkpoint.every_steps=0",
            f"data.batch_size={8 * n}",
        )
        harness.run(cmd, c.work / f"fsdp_vs_data-{name}.log", timeout=budget.left(), env=c.env)
        warm = [e for e in harness.steps(harness.events(run_dir)) if e["step"] > steps // 2]
        out[name] = {"tokens_per_s": harness.median([e["tokens_per_s"] for e in warm]), "mfu": _mfu(warm, "mfu")}
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    out["devices"] = n
    out["fsdp_over_data"] = out["fsdp"]["tokens_per_s"] / out["data"]["tokens_per_s"]
    return out


def part_ab(base: str, what: str, extra: list[str], steps: int) -> Callable[[Check, Budget], dict]:
    """A GPU choice against the main run of the same model: `extra` set, fewer steps, no periodic saves. The
    two ran one after the other on the same warm machine, not interleaved: a first reading, not a verdict."""

    def fn(c: Check, budget: Budget) -> dict:
        main = c.results.get(base, {})
        if "step_s" not in main:
            return {"skipped": f"needs the {base} run's figures, which it has not: {str(main)[:200]}"}
        run = c.runs[base]
        steps_now = max(8, steps // 5) if c.smoke else steps
        trial = Run(run.config, run.overrides, steps_now, 0, run.attention_fallback)
        name = f"ab-{base}-{what}"
        try:
            r = _measure(c, name, trial, extra, budget, retry=[])
        except harness.BenchError as e:
            if budget.spent():
                raise
            return {"set": extra, "ran": False, "error": str(e)[-1500:]}
        r.update(
            set=extra,
            ran=True,
            step_time_vs_main=r["step_s"] / main["step_s"],
            compile_s_vs_main=(r["compile_s"] or 0) / (main.get("compile_s") or float("nan")),
            main={k: main.get(k) for k in ("step_s", "mfu", "compile_s", "overrides")},
        )
        return r

    return fn


def parts(fallback_remat: str) -> list[tuple[str, Callable[[Check, Budget], dict]]]:
    return [
        ("preflight", part_preflight),
        ("copy_bw", part_copy_bw),
        ("gpt2-124m", part_model("gpt2-124m", retry=[])),
        ("gpt-1b", part_model("gpt-1b", retry=[f"model.remat={fallback_remat}"])),
        ("llama-1b", part_model("llama-1b", retry=[f"model.remat={fallback_remat}"])),
        ("bitwise_resume", part_bitwise),
        ("inspect_1b", part_inspect),
        ("fsdp_vs_data", part_fsdp_vs_data),
        ("ab_latency_hiding_124m", part_ab("gpt2-124m", "lhs", ["run.xla_latency_hiding=true"], 60)),
        ("ab_unrolled_124m", part_ab("gpt2-124m", "unrolled", ["model.scan=false"], 60)),
        ("ab_fallback_remat_1b", part_ab("gpt-1b", "remat", [f"model.remat={fallback_remat}"], 40)),
        ("ab_default_mem_fraction_1b", part_ab("gpt-1b", "mem", ["run.gpu_mem_fraction=0"], 30)),
    ]


# --- the record ---------------------------------------------------------------------------------------------


class Record:
    """gpu.json and gpu_logs.txt in the output dir, both rewritten (atomically) after every part."""

    def __init__(self, out_dir: Path, data: dict):
        self.json, self.logs, self.data, self.tails = out_dir / "gpu.json", out_dir / "gpu_logs.txt", data, {}

    def part(self, name: str, value: dict, logs: list[Path]) -> None:
        self.data[name] = value
        for log in logs:
            self.tails[log.name] = harness.tail(log, 60)
        self.write()

    def write(self) -> None:
        _summarize(self.data)
        _atomic(self.json, json.dumps(self.data, indent=1) + "\n")
        _atomic(self.logs, "".join(f"===== {name}\n{text}\n\n" for name, text in self.tails.items()))


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _summarize(r: dict) -> None:
    """The targets and whether the parts that ran so far meet them."""
    det, fast = r.get("bitwise_resume", {}).get("step_s"), r.get("gpt2-124m", {}).get("step_s")
    if det and fast:
        r["deterministic_ops_step_time_ratio"] = det / fast
    mfu = lambda k: r.get(k, {}).get("mfu") or 0  # noqa: E731
    small, one_b = r.get("gpt2-124m", {}), r.get("gpt-1b", {})
    r["targets"] = {
        "mfu_124m": f">= {MFU_TARGET_124M} (causal-half convention)",
        "mfu_1b": f">= {MFU_TARGET_1B}",
        "mfu_llama_1b": f">= {MFU_TARGET_1B}",
        "blocking_vs_copy_limit": f"<= {BLOCKING_TARGET}",
        "bitwise_resume": "equal",
    }
    r["met"] = {
        "mfu_124m": mfu("gpt2-124m") >= MFU_TARGET_124M,
        "mfu_1b": mfu("gpt-1b") >= MFU_TARGET_1B,
        "mfu_llama_1b": mfu("llama-1b") >= MFU_TARGET_1B,
        "blocking_vs_copy_limit": all(x.get("blocking_vs_copy_limit", 99) <= BLOCKING_TARGET for x in (one_b, small)),
        "bitwise_resume": r.get("bitwise_resume", {}).get("bitwise_equal", False),
    }


def check(c: Check, record: Record, *, total_s: float, part_s: dict[str, float]) -> None:
    """Every part in order, each under the shorter of its own budget and what is left of the whole."""
    total, t_start = Budget(total_s, f"time budget of {total_s:g}s"), time.time()
    for name, fn in parts(c.fallback_remat):
        own = part_s[name]
        if total.spent():
            record.part(name, {"skipped": f"time budget of {total_s:g}s spent"}, [])
            continue
        if name.startswith("ab_") and total.remaining() < own:
            record.part(name, {"skipped": f"needs its {own:.0f}s, {total.remaining():.0f}s of the budget left"}, [])
            continue
        mine = own <= total.remaining()
        budget = Budget(
            min(own, total.remaining()), f"its own budget of {own:g}s" if mine else f"time budget of {total_s:g}s"
        )
        t0 = time.time()
        try:
            value = fn(c, budget)
        except Exception as e:  # a bug or a failure of one part never loses the others
            text = str(e) if isinstance(e, harness.BenchError) else traceback.format_exc()
            spent = f"stopped: {budget.label} spent during this part; " if budget.spent() else ""
            value = {"error": spent + text[-2000:]}
        value["part_s"] = round(time.time() - t0, 1)
        value["budget_s"] = own
        c.results[name] = value
        record.data["attention"] = (
            {"runs": "xla (model.attention=xla; xla_remat for the ~1B models)", "why": c.forced_attention}
            if c.forced_attention
            else {"runs": "auto: cuDNN on a GPU in bf16, else xla", "why": "the preflight passed, or has not run"}
        )
        record.data["wall_s"] = round(time.time() - t_start, 1)
        record.part(name, value, [log for log in c.work.glob("*.log") if log.stat().st_mtime >= t0 - 1])


def _parse_part_s(items: list[str], smoke: bool) -> dict[str, float]:
    out = {name: float(SMOKE_PART_S if smoke else s) for name, s in PART_S.items()}
    for item in items:
        name, _, secs = item.partition("=")
        if name not in PART_S:
            raise ValueError(f"--part-s {item}: no part named {name!r}; parts: {', '.join(PART_S)}")
        try:
            out[name] = float(secs)
        except ValueError:
            raise ValueError(f"--part-s {item}: expected NAME=SECONDS") from None
        if out[name] <= 0:
            raise ValueError(f"--part-s {item}: seconds must be > 0")
    return out


def _out_dir(arg: Path | None, work: Path, smoke: bool) -> Path:
    """--out, else $OUT (the device's folder that comes back), else benchmarks/results/ (a GPU run) or the work
    dir (a smoke run: it never overwrites the committed GPU results)."""
    if arg is None:
        arg = (
            Path(os.environ["OUT"]) if os.environ.get("OUT") else work if smoke else harness.ROOT / "benchmarks/results"
        )
    if arg.exists() and not arg.is_dir():
        raise ValueError(f"--out {arg} is a file; pass a directory (gpu.json and gpu_logs.txt are written into it)")
    arg.mkdir(parents=True, exist_ok=True)
    prior = arg / "gpu.json"
    if smoke and prior.is_file():
        try:
            measured = json.loads(prior.read_text()).get("measured")
        except (ValueError, AttributeError):
            measured = False
        if measured:
            raise ValueError(f"--cpu-smoke would overwrite {prior}, a measured GPU result; pass another --out")
    return arg


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("--copy-bw", "--preflight"):  # the subprocess probes
        r = copy_bandwidth(int(argv[1])) if argv[0] == "--copy-bw" else attention_preflight()
        Path(argv[-1]).write_text(json.dumps(r))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny models on CPU: exercises every part of the script")
    p.add_argument("--work", type=Path, default=Path(f"/tmp/trainer-gpu-check-{os.getpid()}"))
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory for gpu.json and gpu_logs.txt (default: $OUT if set, else benchmarks/results/; "
        "with --cpu-smoke the work dir)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"the whole check's budget (default {TOTAL_S:.0f}; {SMOKE_TOTAL_S:.0f} with --cpu-smoke): the running "
        "part is stopped (its process killed) and the rest skipped once it is spent",
    )
    p.add_argument(
        "--part-s",
        action="append",
        default=[],
        metavar="NAME=SECONDS",
        help=f"one part's own budget (repeatable); parts: {', '.join(PART_S)}",
    )
    p.add_argument(
        "--fallback-remat",
        default=FALLBACK_REMAT,
        choices=("full", "save_dots", "save_attention"),
        help="the ~1B runs' remat policy when they do not fit without (default %(default)s)",
    )
    args = p.parse_args(argv)
    total_s = args.budget_s if args.budget_s is not None else SMOKE_TOTAL_S if args.cpu_smoke else TOTAL_S
    try:
        if total_s <= 0:
            raise ValueError(f"--budget-s must be > 0, got {total_s:g}")
        part_s = _parse_part_s(args.part_s, args.cpu_smoke)
        args.work.mkdir(parents=True, exist_ok=True)
        out = _out_dir(args.out, args.work, args.cpu_smoke)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    env = harness.child_env()
    if args.cpu_smoke:
        env["JAX_PLATFORMS"] = "cpu"
    c = Check(args.work, args.cpu_smoke, SMOKE_RUNS if args.cpu_smoke else GPU_RUNS, env, args.fallback_remat)
    data = {
        "measured": not args.cpu_smoke,
        "device_kind_needed": DEVICE_KIND,
        "command": " ".join(["python", "benchmarks/gpu_check.py", *argv]),
        "budget_s": total_s,
        "part_budget_s": part_s,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **harness.provenance(),
    }
    record = Record(out, data)
    record.write()  # provenance first: even a check killed in its first part leaves this much
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped check still runs its `finally`
    try:
        check(c, record, total_s=total_s, part_s=part_s)
    finally:
        record.write()
    print(json.dumps(record.data, indent=1))
    print(f"gpu_check: {record.json} and {record.logs}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
