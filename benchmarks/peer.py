"""Side by side with a peer: nanodo (google-deepmind/nanodo, a clean JAX GPT trainer with FSDP) at the same
dims, driven by ../shared/peer/nanodo/bench_nanodo.py in its own venv, interleaved with our worker:
d_model 256, 4 layers, 4 heads, d_ff 1024, seq 256, global batch 16, bf16 compute, fp32 params (our
vocab 384 for the byte tokenizer vs nanodo's 256: ~1% more compute for us). Median tokens/s of steps 6-35.

Each round runs ours 1 device (scanned layers, the default; unrolled; save_dots; without biases, as
nanodo has none; unrolled without biases), nanodo 1 device, ours fsdp=8,
nanodo FSDP 8, ours data=8 (8 fake CPU devices), alternating which goes first, and records the 1-minute
load average before and after each run: discard rounds where it moved (others took the CPU).

    python -m benchmarks.peer --nanodo-src DIR --nanodo-python VENV/bin/python [--rounds 3] [--settings ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks import harness

PEER = harness.ROOT.parent / "shared" / "peer" / "nanodo"  # bench_nanodo.py and its import stubs (--peer-dir)
OURS = [
    "model.d_model=256",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.d_ff=1024",
    "model.seq_len=256",
    "model.vocab_size=384",
    "model.compute_dtype=bfloat16",
    "data.batch_size=16",
    "checkpoint.every_steps=0",
    "run.compile_cache=",
    "log.progress=false",
    "log.report=false",
]
ONE = ["mesh.cpu_devices=1", "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]
SETTINGS = {  # name -> (our overrides, nanodo's device count or None: ours only)
    "1dev": (ONE, 1),
    "1dev_unrolled": ([*ONE, "model.scan=false"], None),  # nanodo's structure: one compiled block per layer
    # scanned, keeping projections and attention output only: on CPU, stacking the L x L attention
    # residuals of every layer for the scan's backward costs more than recomputing them
    "1dev_save_dots": ([*ONE, "model.remat=save_dots"], None),
    # nanodo's architecture too: no biases in projections or norms (ours keeps GPT-2's by default)
    "1dev_nobias": ([*ONE, "model.bias=false"], None),
    "1dev_unrolled_nobias": ([*ONE, "model.scan=false", "model.bias=false"], None),
    "fsdp8": (["mesh.cpu_devices=8", "mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1"], 8),
    "data8": (["mesh.cpu_devices=8", "mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1"], None),
}

# ratio -> (numerator, denominator, its row in peer.md), in table order
RATIOS = {
    "ours_over_nanodo_1dev": ("ours_1dev", "nanodo_1dev", "1 device, bf16"),
    "ours_unrolled_over_nanodo_1dev": (
        "ours_1dev_unrolled",
        "nanodo_1dev",
        "1 device, bf16, ours unrolled (`model.scan=false`)",
    ),
    "ours_save_dots_over_nanodo_1dev": (
        "ours_1dev_save_dots",
        "nanodo_1dev",
        "1 device, bf16, ours scanned with `model.remat=save_dots`",
    ),
    "ours_nobias_over_nanodo_1dev": (
        "ours_1dev_nobias",
        "nanodo_1dev",
        "1 device, bf16, ours without biases (`model.bias=false`), as nanodo",
    ),
    "ours_unrolled_nobias_over_nanodo_1dev": (
        "ours_1dev_unrolled_nobias",
        "nanodo_1dev",
        "1 device, bf16, ours unrolled and without biases, as nanodo",
    ),
    "ours_fsdp8_over_nanodo_fsdp8": ("ours_fsdp8", "nanodo_fsdp8", "8 devices: ours fsdp=8 vs nanodo FSDP 8"),
    "ours_data8_over_nanodo_fsdp8": ("ours_data8", "nanodo_fsdp8", "8 devices: ours data=8 vs nanodo FSDP 8"),
    "ours_fsdp8_over_ours_data8": ("ours_fsdp8", "ours_data8", "ours fsdp=8 / ours data=8"),
}


def _ours(work: Path, name: str, mesh: list[str], steps: int) -> dict:
    run_dir = work / f"ours-{name}"
    cmd = harness.trainer_cmd(harness.TINY, run_dir, *OURS, *mesh, f"train.steps={steps}", worker=True)
    wall = harness.run(cmd, work / f"ours-{name}.log", timeout=900)
    evs = harness.events(run_dir)
    tps = [e["tokens_per_s"] for e in harness.steps(evs) if e["step"] > 5]
    compiled = next(e["seconds"] for e in evs if e["event"] == "compiled")
    first = next(e["step_s"] for e in harness.steps(evs) if e["step"] == 1)
    return {"tokens_per_s": statistics.median(tps), "compile_s": compiled, "first_step_s": first, "wall_s": wall}


def _nanodo(work: Path, name: str, devices: int, steps: int, src: Path, python: str, peer: Path) -> dict:
    out = work / f"nanodo-{name}.json"
    env = harness.child_env(PYTHONPATH=f"{peer / 'stubs'}:{src}", JAX_PLATFORMS="cpu")
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    wall = harness.run(
        [python, str(peer / "bench_nanodo.py"), "--steps", str(steps), "--out", str(out)],
        work / f"nanodo-{name}.log",
        timeout=900,
        env=env,
    )
    r = json.loads(out.read_text())
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"][5:]),
        "first_step_s": r["first_step_s"],
        "wall_s": wall,
        "param_specs": r["param_specs"],
    }


def _timed(fn, *args) -> dict:
    before = os.getloadavg()[0]
    t = time.time()
    out = fn(*args)
    return dict(out, loadavg_before=before, loadavg_after=os.getloadavg()[0], started=t)


def measure(work: Path, *, rounds: int, steps: int, src: Path, python: str, peer: Path, settings: list[str]) -> dict:
    runs: list[dict] = []
    for r in range(rounds):
        for name in settings:
            mesh, peer_devices = SETTINGS[name]
            order = ["ours", "nanodo"] if r % 2 == 0 else ["nanodo", "ours"]
            for who in order:
                if who == "nanodo" and peer_devices is None:
                    continue
                tag = f"{name}-r{r}"
                rec = (
                    _timed(_ours, work, tag, mesh, steps)
                    if who == "ours"
                    else _timed(_nanodo, work, tag, peer_devices, steps, src, python, peer)
                )
                runs.append({"round": r, "setting": name, "who": who, **rec})
                print(json.dumps(runs[-1]), flush=True)
    return {"runs": runs, **summarize(runs)}


def summarize(runs: list[dict]) -> dict:
    med = {}
    for name in SETTINGS:
        for who in ("ours", "nanodo"):
            vals = [x["tokens_per_s"] for x in runs if x["setting"] == name and x["who"] == who]
            if vals:
                med[f"{who}_{name}"] = statistics.median(vals)
    ratios = {k: med[a] / med[b] for k, (a, b, _) in RATIOS.items() if a in med and b in med}
    return {"median_tokens_per_s": med, "ratios": ratios}


def render(result: dict) -> str:
    med, rat = result["median_tokens_per_s"], result["ratios"]
    loads = [x["loadavg_before"] for x in result["runs"]] + [x["loadavg_after"] for x in result["runs"]]
    lines = [
        "# Peer: ours vs nanodo at the same dims",
        "",
        f"`{result['command']}` — {len(result['runs'])} runs, 1-min load average {min(loads):.2f} .. "
        f"{max(loads):.2f} on {os.cpu_count()} CPUs (per run in peer.json)",
        "",
        "| setting | ours tok/s | nanodo tok/s | ratio |",
        "|---|---|---|---|",
    ]
    for r, (a, b, label) in RATIOS.items():
        if r in rat:  # tok/s columns for the rows against nanodo; ours vs ours shows the ratio alone
            tps = f" {med[a]:,.0f} | {med[b]:,.0f} " if b.startswith("nanodo") else " | "
            lines.append(f"| {label} |{tps}| {rat[r]:.2f} |")
    lines += [
        "",
        "Medians over rounds of each run's median tokens/s of steps 6-35 (ours: events.jsonl; nanodo: the",
        "interval between its metric read-backs, the same definition). Method: benchmarks/peer.py.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nanodo-src", type=Path, required=True, help="nanodo's source tree (git archive of 10aefde)")
    p.add_argument("--nanodo-python", required=True, help="python of a scratch venv with jax, flax, optax, clu ...")
    p.add_argument("--peer-dir", type=Path, default=PEER, help="the shared peer harness (bench_nanodo.py, stubs/)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=35)
    p.add_argument(
        "--settings",
        nargs="+",
        choices=list(SETTINGS),
        default=list(SETTINGS),
        help="run only these settings (default: all)",
    )
    p.add_argument("--work", type=Path, default=Path(f"/tmp/trainer-peer-{os.getpid()}"))
    p.add_argument("--out", type=Path, default=harness.ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    result = measure(
        args.work,
        rounds=args.rounds,
        steps=args.steps,
        src=args.nanodo_src,
        python=args.nanodo_python,
        peer=args.peer_dir,
        settings=args.settings,
    )
    result["command"] = " ".join(["python -m benchmarks.peer", *argv])
    result.update(harness.provenance())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peer.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "peer.md").write_text(render(result))
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
