"""The batch host's guard: a job must not outlive its supervisor.

Under SLURM the supervisor runs on the job's first node (the batch host). The job is submitted with
--no-kill so that it outlives the loss of any other node (a spare takes its place). But SLURM keeps such a
job running when the batch host itself is lost too: it removes the node from the job and leaves an
allocation with no batch script, no supervisor and nothing training, until its time limit
(docs/multihost.md says which slurmctld was seen doing so). Every GPU of the allocation idles for the rest
of the time limit.

So the supervisor renews a lease (RUN_DIR/heartbeat/supervisor.json, a counter bumped by a thread of its
own every RENEW_S) and runs one guard on every other node of the allocation, as a job step of its own
(`srun --overlap`, no task on the batch host: SLURM ends the steps that had a task on a failed node, and
this one has none there). A guard that sees the counter unchanged for STALE_S by its own clock (no clock
comparisons between nodes) requeues the job (`scontrol requeue`); SLURM starts it again on nodes that are
up, and the new supervisor resumes from the newest complete checkpoint in either tier; the guard marks the
lost batch host suspect first, so no later step trains on it. (Excluding it from the requeued job,
`scontrol update ExcNodeList`, cannot be relied on from here: slurmctld may refuse the update while the
requeue is completing, and the requeue ends the guard's own step. Until SLURM marks the node down, the
requeued job may be placed there.) A frozen supervisor
is caught the same way. A job submitted without --requeue cannot be requeued: the guard then cancels it
(`scancel`), which at least frees the allocation. What the guard did is in the job's output; the event
`supervisor_lost` is written before it acts (the requeue ends the guard's own step).

Never imports jax: a guard starts in a fraction of a second and holds no GPU.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from trainer.observe.events import EventLog
from trainer.store import env_vars, rundir
from trainer.store.event_names import SUPERVISOR_LOST
from trainer.store.rundir import read_json, write_json
from trainer.supervise.nodes import read_suspects, write_suspects

RENEW_S = 1.0
STALE_S = 20.0  # a supervisor renews every second from a thread that does nothing else
LEASE = "supervisor.json"


def lease_path(run_dir: Path) -> Path:
    return Path(run_dir) / rundir.HEARTBEAT / LEASE


def renew_forever(run_dir: Path, node: str) -> threading.Thread:
    """The supervisor's side: a daemon thread that bumps the lease counter every RENEW_S."""
    lease_path(run_dir).parent.mkdir(parents=True, exist_ok=True)

    def loop() -> None:
        beat = 0
        while True:
            beat += 1
            try:
                write_json(lease_path(run_dir), {"beat": beat, "pid": os.getpid(), "node": node}, indent=None)
            except OSError:  # storage hiccup: the next beat tries again; a long one reads as a lost supervisor
                pass
            time.sleep(RENEW_S)

    thread = threading.Thread(target=loop, name="supervisor-lease", daemon=True)
    thread.start()
    return thread


def srun_command(nodes: list[str], run_dir: Path, job: str) -> list[str]:
    """One guard per node in `nodes` (the allocation but the batch host), as a step of its own."""
    return [
        "srun",
        f"--nodes={len(nodes)}",
        f"--ntasks={len(nodes)}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(nodes)}",
        "--overlap",  # beside the training steps, on the resources they hold
        "--cpus-per-task=1",
        "--gpus-per-task=0",
        "--no-kill",  # a guard's node lost (a training node lost) is no reason to end the others
        "--kill-on-bad-exit=0",
        "--job-name=trainer-guard",
        sys.executable,
        "-m",
        "trainer.supervise.guard",
        str(run_dir),
        job,
    ]


def guard_env(env: Mapping[str, str]) -> dict[str, str]:
    # The job's per-task settings (GPUs, cores) are the training step's, not the guard's.
    drop = (env_vars.SLURM_GPUS_PER_TASK, env_vars.SRUN_CPUS_PER_TASK, env_vars.SLURM_CPUS_PER_TASK)
    return {k: v for k, v in env.items() if k not in drop}


def watch(run_dir: Path, job: str, stale_s: float = STALE_S, poll_s: float = 1.0) -> int:
    """The guard's loop: returns once it has requeued (or cancelled) the job whose supervisor went silent."""
    last, since = None, time.monotonic()
    while True:
        lease = read_json(lease_path(run_dir)) or {}
        if lease.get("beat") != last:
            last, since = lease.get("beat"), time.monotonic()
        elif time.monotonic() - since > stale_s:
            return _requeue(run_dir, job, lease, time.monotonic() - since)
        time.sleep(poll_s)


def _state(job: str) -> str:
    r = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=60)
    return r.stdout.strip()


def _requeue(run_dir: Path, job: str, lease: dict, silent_s: float) -> int:
    # One guard per node sees the same silence at about the same time: the first to act does it all.
    if _state(job) != "RUNNING":
        return 0
    node, lost = os.environ.get(env_vars.SLURMD_NODENAME, "?"), lease.get("node") or ""
    # Recorded first: the requeue ends the job's steps, this guard's too (SIGTERM, then SIGKILL after KillWait).
    # The lost batch host is a suspect like any lost node (`status` lists it; the requeued job's supervisor
    # avoids it).
    if lost:
        path = Path(run_dir) / rundir.SUSPECT_NODES
        suspects = read_suspects(path)
        reason = "the batch host: the supervisor's lease stopped (a guard requeued the job)"
        suspects.setdefault(lost, {"reason": reason, "time": time.time(), "job": job})
        write_suspects(path, suspects)
    EventLog(Path(run_dir) / rundir.EVENTS, by="guard").write(
        SUPERVISOR_LOST, node=lost, guard_node=node, silent_s=round(silent_s, 1)
    )
    print(f"guard on {node}: the supervisor on {lost} is silent for {silent_s:.0f}s: requeueing job {job}", flush=True)
    r = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        if _state(job) != "RUNNING":  # another guard's requeue came first: nothing left to do
            return 0
        print(f"guard: requeue refused ({r.stderr.strip()[-200:]}): cancelling the job", flush=True)
        subprocess.run(["scancel", job], capture_output=True, timeout=60)  # at least free the allocation
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    p.add_argument("job")
    a = p.parse_args()
    return watch(Path(a.run_dir), a.job)


if __name__ == "__main__":
    sys.exit(main())
