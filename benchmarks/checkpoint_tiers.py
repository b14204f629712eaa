"""#7 Checkpoint tiers on the >= 100M-parameter state of benchmark #2 (one CPU device): steady tokens/s with
one save per ~10 s window vs none, for the durable tier (compressed, fsynced, shared directory) and the
node-local tier (uncompressed, this process's own directory) on a RAM disk and on the local disk, side by
side; blocking per save; the CPU cost of sealing (sha256 manifests); restore latency (verify + read) of
each tier. All through the trainer's own Checkpointer, manifests included.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.checkpoint_cost import MODEL, QUICK_MODEL, _Bench, _windows

TARGET = 0.97
WINDOW_S = 10.0


def _restore_s(ck, step: int, abstract) -> dict:
    """Seconds to verify a checkpoint's manifests and to read it back (page cache warm: just written)."""
    import jax

    t0 = time.perf_counter()
    problem = ck.verify(step)
    t1 = time.perf_counter()
    restored = ck.restore(step, abstract)
    jax.block_until_ready(restored.state)
    t2 = time.perf_counter()
    assert problem is None, problem
    return {"verify_s": t1 - t0, "read_s": t2 - t1, "total_s": t2 - t0}


def _seal_cpu_s(step_dir: Path) -> dict:
    from trainer.store import manifest

    c0, t0 = time.process_time(), time.perf_counter()
    manifest.write(step_dir, process=0, processes=1, durable=False)
    size = sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())
    return {"cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - t0, "bytes": size}


def _save_cpu_s(b: _Bench, directory: Path, tier: str) -> dict:
    """CPU-seconds (all threads) of one synchronous save, sealing included: what a save takes from training on
    a CPU host whatever the neighbours' load (wall-clock ratios move with it)."""
    from trainer.ckpt.checkpoint import Checkpointer
    from trainer.config import CheckpointConfig

    shutil.rmtree(directory, ignore_errors=True)
    ck = Checkpointer(directory, CheckpointConfig(keep_latest=1, async_save=False), tier=tier)
    b.steps(1)
    c0, t0 = time.process_time(), time.perf_counter()
    b.save(ck)
    ck.wait()
    out = {"cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - t0}
    ck.close()
    shutil.rmtree(directory, ignore_errors=True)
    return out


def _tier(b: _Bench, directory: Path, tier: str, n: int, rounds: int) -> dict:
    from trainer.ckpt.checkpoint import Checkpointer
    from trainer.config import CheckpointConfig

    sync = _save_cpu_s(b, directory, tier)
    ck = Checkpointer(directory, CheckpointConfig(keep_latest=1), tier=tier)
    w = _windows(b, ck, n, rounds)
    step = ck.steps()[-1]
    out = {
        "ckpt_throughput_ratio": w["ckpt_tokens_per_s"] / w["plain_tokens_per_s"],
        "blocking_s": w["async_blocking_s"],
        "write_wait_after_window_s": w["write_wait_after_window_s"],
        "cpu_time_ratio": w["cpu_time_ratio"],
        "restore": _restore_s(ck, step, b.spec.abstract),
        "seal": _seal_cpu_s(ck.step_dir(step)),
        "directory": str(directory),
        "sync_save": sync,
        # The most a ~10 s window on this many cores can keep when a save's CPU work shares them.
        "cpu_bound_throughput_ratio": 1 - sync["cpu_s"] / (WINDOW_S * os.cpu_count()),
    }
    ck.close()
    shutil.rmtree(directory, ignore_errors=True)
    return out


def measure(work: Path, quick: bool) -> dict:
    b = _Bench(QUICK_MODEL if quick else MODEL)
    b.steps(2)
    t0 = time.perf_counter()
    b.steps(2)
    step_s = (time.perf_counter() - t0) / 2
    n = max(2, round((2.0 if quick else WINDOW_S) / step_s))
    rounds = 1 if quick else 3
    ram = Path("/dev/shm") if Path("/dev/shm").is_dir() else work
    res = {
        "durable": _tier(b, work / "durable", "durable", n, rounds),
        "local_ram_disk": _tier(b, ram / f"trainer-bench-local-{os.getpid()}", "local", n, rounds),
        "local_disk": _tier(b, work / "local", "local", n, rounds),
    }
    local, durable = res["local_ram_disk"], res["durable"]
    return {
        "local_ckpt_throughput_ratio": local["ckpt_throughput_ratio"],
        "durable_ckpt_throughput_ratio": durable["ckpt_throughput_ratio"],
        "restore_local_vs_durable": local["restore"]["total_s"] / durable["restore"]["total_s"],
        "cpu_bound_local": local["cpu_bound_throughput_ratio"],
        "cpu_bound_durable": durable["cpu_bound_throughput_ratio"],
        "targets": {"local_ckpt_throughput_ratio": f">= {TARGET}", "restore_local_vs_durable": "<= 1"},
        "met": {
            "local_ckpt_throughput_ratio": local["ckpt_throughput_ratio"] >= TARGET,
            "restore_local_vs_durable": local["restore"]["total_s"] <= durable["restore"]["total_s"],
        },
        "tiers": res,
        "n_params": b.n_params,
        "state_bytes": b.state_bytes,
        "step_s": step_s,
        "window_steps": n,
        "setup": f"{' '.join(QUICK_MODEL if quick else MODEL)} (fp32 params + AdamW state), one CPU device; the "
        "trainer's Checkpointer per tier (sealing included), keep 1; windows of n steps alternate without /"
        " with one save at their start (~10 s each); local tier on /dev/shm (RAM disk) and on the work disk",
    }


def main(argv: list[str]) -> int:
    args = harness.cli(__doc__.splitlines()[0], argv)
    os.environ["JAX_PLATFORMS"] = "cpu"
    work = args.work / "checkpoint_tiers"
    harness.emit(args, measure(work, args.quick))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
