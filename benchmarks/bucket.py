"""The durable tier in an S3 bucket against a local directory, side by side in one run (issue 46): for the
tiny config's state and the >= 100M-parameter state of benchmark #2 (one CPU device), through the trainer's
own Checkpointer: the seconds a save blocks training, the seconds until it is committed, sealed and (in the
bucket) uploaded, and a restore's seconds (in the bucket: download into the empty staging directory, verify,
read). The bucket is moto's S3 server on loopback (tests/buckets.py): no network, a Python server; a real
bucket's bandwidth is discussed in docs/checkpointing.md.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.checkpoint_cost import MODEL, QUICK_MODEL, _Bench

sys.path.insert(0, str(harness.ROOT / "tests"))


def _one(b: _Bench, directory: Path, url: str | None) -> dict:
    """One save into a fresh tier and one restore of it, each timed."""
    import jax

    from trainer.ckpt.checkpoint import Checkpointer
    from trainer.config import CheckpointConfig

    shutil.rmtree(directory, ignore_errors=True)
    ck = Checkpointer(directory, CheckpointConfig(keep_latest=1), remote=url)
    b.steps(1)
    t0 = time.perf_counter()
    blocking = b.save(ck)
    ck.wait()
    sealed = time.perf_counter() - t0
    assert ck.failure is None, ck.failure
    step = ck.steps()[-1]
    size = sum(p.stat().st_size for p in ck.step_dir(step).rglob("*") if p.is_file())
    ck.close()
    if url:
        shutil.rmtree(directory)  # a restore on a node that never had it: everything comes from the bucket
    ck = Checkpointer(directory, CheckpointConfig(keep_latest=1), remote=url)
    t0 = time.perf_counter()
    ck.fetch(step)
    ck.reload()
    t1 = time.perf_counter()
    problem = ck.verify(step)
    restored = ck.restore(step, b.spec.abstract, meta=lambda: None)
    jax.block_until_ready(restored.state)
    t2 = time.perf_counter()
    assert problem is None, problem
    ck.close()
    shutil.rmtree(directory, ignore_errors=True)
    return {
        "blocking_s": blocking,
        "saved_and_sealed_s": sealed,
        "restore_s": t2 - t0,
        "download_s": t1 - t0,
        "bytes": size,
    }


def measure(work: Path, quick: bool) -> dict:
    from buckets import S3Server

    server = S3Server()
    server.start()
    os.environ.update(server.env)
    out: dict = {}
    try:
        for name, overrides in (("tiny", []), ("100M", QUICK_MODEL if quick else MODEL)):
            b = _Bench(overrides)
            server.make_bucket(f"bench-{name.lower()}")
            local = _one(b, work / f"{name}-local", None)
            s3 = _one(b, work / f"{name}-s3", f"s3://bench-{name.lower()}/run")
            out[name] = {
                "n_params": b.n_params,
                "state_bytes": b.state_bytes,
                "local_dir": local,
                "s3": s3,
                "save_blocking_s3_vs_local": s3["blocking_s"] / local["blocking_s"],
                "saved_and_sealed_s3_vs_local": s3["saved_and_sealed_s"] / local["saved_and_sealed_s"],
                "restore_s3_vs_local": s3["restore_s"] / local["restore_s"],
                "upload_MBps": s3["bytes"] / 1e6 / max(s3["saved_and_sealed_s"] - local["saved_and_sealed_s"], 1e-9),
            }
    finally:
        server.stop()
    return {
        "sizes": out,
        "setup": "the trainer's Checkpointer, one save then one restore per tier; local: a directory on the work "
        "disk; s3: moto's S3 server on 127.0.0.1 (Python, in memory), staging on the work disk, emptied before "
        f"the restore; 100M: {' '.join(QUICK_MODEL if quick else MODEL)}",
    }


def main(argv: list[str]) -> int:
    args = harness.cli(__doc__.splitlines()[0], argv)
    os.environ["JAX_PLATFORMS"] = "cpu"
    work = args.work / "bucket"
    harness.emit(args, measure(work, args.quick))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
