"""The fire drill inside a SLURM allocation, node loss among its faults: a private cluster of daemons on
loopback (tests/slurm_cluster.py: root and the SLURM packages, .ci/install-slurm.sh), each node with its own
RAM disk as the node-local tier, and `sbatch launch/slurm.sbatch drill ...` on it: 2 nodes train, the others
are spares. Writes the drill's table (stdout of the job), drill.json and drill.png into --out.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness

ROOT = harness.ROOT
sys.path.insert(0, str(ROOT / "tests"))
from multihost import TWO, sbatch_trainer, small_corpus  # noqa: E402
from slurm_cluster import local_slurm, wait_job  # noqa: E402

NODE_LOCAL = "/local_scratch"
# The tiny config as the 20-minute local drill runs it (benchmarks/README), on 2 processes x 4 devices.
SETS = (
    "supervisor.step_timeout_s=20",
    "supervisor.restore_timeout_s=30",
    "supervisor.startup_timeout_s=120",
    "integrity.replica_check_steps=50",
    "launch.processes_per_node=1",
    f"checkpoint.local_dir={NODE_LOCAL}/ckpt",
    "checkpoint.local_every_steps=10",
    *TWO,
)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=6.0)
    p.add_argument("--mtbf", type=float, default=15.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--spares", type=int, default=2)
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "drill" / "slurm")
    args = p.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="drill-slurm-"))
    corpus = small_corpus(work / "corpus")  # a corpus every node reads (the job's cwd is the repo)
    drill_dir, out = work / "drill", work / "job.out"
    sets = [*SETS, f"run.dir={work / 'mine'}", f"data.path={corpus}", f"data.cache_dir={work / 'cache'}"]
    cmd = ["drill", "--config", harness.TINY, *[a for s in sets for a in ("--set", s)], "--dir", str(drill_dir)]
    cmd += ["--minutes", str(args.minutes), "--mtbf", str(args.mtbf), "--seed", str(args.seed)]
    nodes = 2 + args.spares
    t0 = time.time()
    with local_slurm(
        work / "slurm", nodes=nodes, cpus=2, cred_expire=5, slurmd_timeout=5, message_timeout=3, node_local=NODE_LOCAL
    ) as env:
        job, _ = sbatch_trainer(env, nodes=nodes, per_node=1, out=out, args=cmd)
        state = wait_job(job, env, timeout=4 * args.minutes * 60 + 1800)
    log = out.read_text()
    print(log)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("drill.json", "drill.png"):
        if (drill_dir / name).is_file():
            shutil.copy(drill_dir / name, args.out / name)
    command = "python -m benchmarks.drill_slurm " + " ".join(argv)
    (args.out / "drill.txt").write_text(f"$ {command}\n(job {state}, {time.time() - t0:.0f} s)\n\n{log}")
    return 0 if state == "COMPLETED" else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
