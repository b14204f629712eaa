"""The private loopback SLURM cluster of tests/slurm_cluster.py (the harness tests/test_slurm_job.py runs
launch/slurm.sbatch on) leaves nothing behind: its teardown kills running jobs and every daemon.

What the job script needs from SLURM (2 tasks with SLURM_PROCID/SLURM_STEP_NODELIST, a new srun step
after a task was SIGKILLed, SIGTERM to the batch shell then `scontrol requeue`) is exercised by
tests/test_slurm_job.py on the real trainer; the smoke tests that checked SLURM alone are gone.

Skipped when SLURM is not installed (see .ci/install-slurm.sh) or not root, unless $CI is set, in which
case that is a failure.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from slurm_cluster import cluster_pids, job_info, local_slurm, sbatch, slurm_available, wait_for  # noqa: E402

pytestmark = pytest.mark.slow  # a private SLURM cluster (fast loop: -m 'not slow')


def _require_slurm() -> None:
    reason = None
    if not slurm_available():
        reason = "SLURM binaries not installed (run .ci/install-slurm.sh)"
    elif os.geteuid() != 0:
        reason = "local SLURM cluster needs root (slurmd)"
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but {reason}")
        pytest.skip(reason)


def test_teardown_kills_running_jobs(tmp_path: Path):
    _require_slurm()
    started = tmp_path / "started"
    script = tmp_path / "long.sbatch"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --ntasks=2
        #SBATCH --output={tmp_path}/long.out
        srun bash -c 'touch {started}.$SLURM_PROCID; trap "" TERM; sleep 600'
        """))
    script.chmod(0o755)
    with local_slurm(tmp_path / "slurm", cpus=4) as env:
        job = sbatch(script, env, f"--chdir={tmp_path}")
        wait_for(lambda: all((tmp_path / f"started.{i}").exists() for i in range(2)), timeout=30, what="tasks")
        assert len(cluster_pids(env)) >= 4  # stepds + tasks
        assert job_info(job, env)["JobState"] == "RUNNING"
    assert cluster_pids(env) == []
