"""Shared pieces of the multi-process tests (not a test module): a 2-process x 2-device micro config on
a corpus small enough to span several epochs, and one uninterrupted reference run per test session."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from conftest import MICRO, ROOT, TINY, built_once, run_trainer, sets
from slurm_cluster import TERMINAL_STATES, job_state

# A corpus of ~140 windows of 65 tokens: 30 steps x 16 sequences cross three epoch boundaries, so the
# audit proves exactly-once per epoch, not just "no repeats in 2% of an epoch".
WORDS = "the a data step shard host mesh save restore loss batch epoch window token seed order".split()

# Same global batch and global device count (4: data 2 x fsdp 2) whatever the process count; in a group the
# data axis spans the processes (gloo) and fsdp lies within each. Two devices a process, not the tiny config's
# four (x tensor 2): a 2-process step costs about half the CPU (0.08-0.10 s against 0.18 s a step,
# benchmarks/results/suite_history.md), and the suite is CPU-bound on CI's 2 cores. The tensor axis is
# covered on one process (tests/test_resume.py, test_sharding.py, test_export.py's restore onto 2 x 2 x 2).
TWO = ["launch.processes=2", "mesh.cpu_devices=2", "mesh.tensor=1"]
ONE = ["launch.processes=1", "mesh.cpu_devices=4", "mesh.tensor=1"]


def small_corpus(directory: Path) -> Path:
    path = Path(directory) / "corpus.txt"
    if not path.is_file():
        rng = random.Random(0)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(" ".join(rng.choice(WORDS) for _ in range(1600)))
    return path


def group_overrides(corpus: Path, *more: str) -> list[str]:
    return [
        f"data.path={corpus}",
        f"data.cache_dir={corpus.parent / 'cache'}",
        "data.audit=true",
        "supervisor.backoff_s=0.2",
        *more,
    ]


def reference(tmp_path_factory) -> tuple[Path, Path]:
    """(run dir, corpus) of one uninterrupted, supervised 2-process run; made once per session (conftest.built_once)."""

    def build(root: Path) -> None:
        run_trainer(root / "reference", *group_overrides(small_corpus(root / "corpus"), *TWO))

    root = built_once(tmp_path_factory, "multihost-reference", build)
    return root / "reference", root / "corpus" / "corpus.txt"


def heartbeat(run: Path, process: int) -> dict | None:
    try:
        return json.loads((run / "heartbeat" / f"worker-{process}.json").read_text())
    except (OSError, ValueError):
        return None


def wait_for(pred, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if v := pred():
            return v
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def at_step(run: Path, process: int, step: int, alive, timeout: float = 240, not_pid: int | None = None) -> dict:
    """Wait until that process is training at `step` or later; its heartbeat (with its pid).
    `alive()` says whether the run is still going (fail fast when it is not); `not_pid`: a later attempt's."""

    def ok():
        assert alive(), f"the run ended before process {process} reached step {step}"
        hb = heartbeat(run, process)
        return hb if hb and hb["phase"] == "step" and hb["step"] >= step and hb["pid"] != not_pid else None

    return wait_for(ok, timeout, f"process {process} at step >= {step}")


def audit(run: Path, *args: str) -> dict:
    """`python -m trainer audit RUN --json`, asserted to pass."""
    p = subprocess.run(
        [sys.executable, "-m", "trainer", "audit", str(run), "--json", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout)


def sbatch_trainer(
    env: dict[str, str], *, nodes: int, per_node: int, out: Path, args: list[str]
) -> tuple[str, Callable[[], bool]]:
    """Submit launch/slurm.sbatch running `python -m trainer <args>` with this interpreter to a loopback cluster
    (tests/slurm_cluster.py), one core and no GPU per task (the job script asks for a GPU node's GPUs and
    cores): (the job id, alive: whether the job has not ended yet)."""
    cmd = ["sbatch", "--parsable", f"--nodes={nodes}", f"--ntasks={nodes * per_node}", f"--ntasks-per-node={per_node}"]
    cmd += ["--gpus-per-task=0", "--cpus-per-task=1", f"--chdir={ROOT}", f"--output={out}"]
    cmd += [str(ROOT / "launch" / "slurm.sbatch"), *args]
    env = dict(env, TRAINER_PYTHON=sys.executable)
    job = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    return job, lambda: job_state(job, env) not in TERMINAL_STATES


def node_of(pid: int) -> str:
    """The SLURM node a task runs on (its SLURMD_NODENAME), read from outside."""
    env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return next(v.split(b"=", 1)[1].decode() for v in env if v.startswith(b"SLURMD_NODENAME="))


def job_args(run: Path, corpus: Path, *more: str) -> list[str]:
    """`python -m trainer` arguments for a SLURM job of the 2-process micro run (launch/slurm.sbatch adds
    launch.mode=slurm): the reference's config, into `run`, plus `more`."""
    return ["--config", TINY, *sets(*MICRO, f"run.dir={run}", *group_overrides(corpus, *TWO), *more)]
