"""What of a restart grows with the process count (issue 44, item 4), measured at 2, 4, 8 and 12 processes:

1. jax.distributed: N local processes, started together as a restart starts them, each timing its
   `jax.distributed.initialize` (the trainer's: processes other than 0 dial the coordinator until it listens)
   and then 20 rounds of the loop's agreement (trainer.parallel.agree: the key-value exchange every step makes).
2. srun: on the loopback SLURM (tests/slurm_cluster.py, one slurmd per node; root and SLURM's daemons), N nodes
   and one task per node, the wall time of `srun true` inside the job (a step's creation, launch and end across
   the nodes), 5 times each.

No training here: the compile and the first step's collectives are what a GPU changes most (multihost.md).

    python -m benchmarks.downtime_scale --out benchmarks/results/downtime_scale.json     # ~3 min
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks import harness

ROOT = harness.ROOT
COUNTS = (2, 4, 8, 12)

# One process of the group: join, then agree 20 times; prints its timings as one JSON line.
PROCESS = r"""
import json, sys, time
from trainer.config import LaunchConfig
from trainer.parallel import distributed
from trainer.parallel.agree import Agreement
import dataclasses, jax

@dataclasses.dataclass
class F:
    stop: bool = False

t0 = time.time()
me = distributed.initialize(LaunchConfig(processes=int(sys.argv[1])), cpu=True)
t1 = time.time()
a = Agreement(F, processes=me.processes, start=0)
rounds = []
for step in range(1, 23):
    s = time.perf_counter()
    a.exchange(step, F())
    rounds.append(time.perf_counter() - s)
print(json.dumps({"process": me.process_id, "init_s": t1 - t0, "agree_s": rounds[2:]}), flush=True)
client = distributed.coordination_client()
client.key_value_set(f"done/{me.process_id}", "1")
if me.process_id == 0:  # the coordination service lives in process 0: it leaves last
    for i in range(me.processes):
        client.blocking_key_value_get(f"done/{i}", 60000)
import os; os._exit(0)
"""


def jax_group(n: int) -> dict:
    from trainer.supervise.launcher import free_port

    port = free_port()
    base = dict(harness.child_env(), TRAINER_NUM_PROCESSES=str(n), TRAINER_COORDINATOR=f"127.0.0.1:{port}")
    base["JAX_PLATFORMS"] = "cpu"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PROCESS, str(n)],
            env=dict(base, TRAINER_PROCESS_ID=str(i)),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for i in range(n)
    ]
    rows = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
    return {
        "init_s_max": round(max(r["init_s"] for r in rows), 3),
        "init_s_median": round(statistics.median(r["init_s"] for r in rows), 3),
        "agree_round_ms_median": round(1000 * statistics.median(x for r in rows for x in r["agree_s"]), 3),
    }


def srun_steps(work: Path, n: int) -> list[float]:
    sys.path.insert(0, str(ROOT / "tests"))
    from slurm_cluster import local_slurm, wait_job

    out = work / f"srun{n}.out"
    script = "for i in 1 2 3 4 5; do a=$(date +%s.%N); srun --overlap true; b=$(date +%s.%N); echo $a $b; done"
    with local_slurm(work / f"slurm{n}", nodes=n, cpus=1, cred_expire=5) as env:
        cmd = ["sbatch", "--parsable", f"--nodes={n}", f"--ntasks={n}", f"--output={out}", f"--wrap={script}"]
        job = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=30).stdout.strip()
        state = wait_job(job, env, timeout=300)
        if state != "COMPLETED":
            raise harness.BenchError(f"srun job {state}: {out.read_text()[-2000:]}")
    return [round(float(b) - float(a), 3) for a, b in (ln.split() for ln in out.read_text().splitlines() if ln)]


def main(argv: list[str]) -> int:
    args = harness.cli(__doc__.splitlines()[0], argv)
    counts = (2, 4) if args.quick else COUNTS
    result: dict = {"command": "python -m benchmarks.downtime_scale" + (" --quick" if args.quick else "")}
    result["jax_distributed"] = {str(n): jax_group(n) for n in counts}
    sys.path.insert(0, str(ROOT / "tests"))
    from slurm_cluster import slurm_available

    if slurm_available() and os.geteuid() == 0:
        result["srun_step_s"] = {}
        for n in counts:
            t = srun_steps(args.work, n)
            result["srun_step_s"][str(n)] = {"each": t, "median": statistics.median(t)}
    result["machine"] = harness.machine()
    harness.emit(args, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
