"""Smoke tests for the private loopback SLURM cluster in tests/slurm_cluster.py.

They also pin down the SLURM behaviours the real multi-process training job
script relies on:

* ``sbatch --ntasks=2`` + ``srun`` starts 2 tasks with SLURM_PROCID /
  SLURM_NTASKS / SLURM_STEP_NODELIST set;
* inside one allocation a new ``srun`` step can be launched after a previous
  step failed (task exit 1, or a task SIGKILLed) -- the job is not torn down;
* the batch script gets SIGTERM from ``scancel --batch --signal=TERM`` (or from
  ``#SBATCH --signal=B:TERM@<secs>``), can run ``scontrol requeue
  $SLURM_JOB_ID`` and the job runs again with SLURM_RESTART_COUNT=1.

Skipped when SLURM is not installed (see .ci/install-slurm.sh) or not root,
unless $CI is set, in which case that is a failure.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from slurm_cluster import (  # noqa: E402
    cluster_pids,
    job_info,
    local_slurm,
    sbatch,
    slurm_available,
    wait_for,
    wait_job,
)

PY = shlex.quote(sys.executable)
PRINT_RANK = shlex.quote(
    'import os; print(os.environ["SLURM_PROCID"], os.environ["SLURM_NTASKS"], os.environ["SLURM_STEP_NODELIST"])'
)
PRINT_STEP = shlex.quote('import os; print("step2 task", os.environ["SLURM_PROCID"], os.environ["SLURM_STEP_ID"])')


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


@pytest.fixture
def slurm(tmp_path: Path):
    _require_slurm()
    workdir = tmp_path / "slurm"
    with local_slurm(workdir, cpus=8) as env:
        yield env, tmp_path
    # nothing of this cluster may survive the context manager
    assert cluster_pids(env) == []


def _write_script(path: Path, body: str) -> Path:
    path.write_text(textwrap.dedent(body).lstrip())
    path.chmod(0o755)
    return path


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_sbatch_two_tasks(slurm):
    env, tmp = slurm
    out = tmp / "smoke.out"
    script = _write_script(
        tmp / "smoke.sbatch",
        f"""
        #!/bin/bash
        #SBATCH --job-name=smoke
        #SBATCH --ntasks=2
        #SBATCH --output={out}
        #SBATCH --time=2
        srun {PY} -c {PRINT_RANK}
        """,
    )
    t0 = time.monotonic()
    job = sbatch(script, env, f"--chdir={tmp}")
    state = wait_job(job, env, timeout=45)
    elapsed = time.monotonic() - t0
    text = _read(out)
    assert state == "COMPLETED", text
    host = env_host(env)
    lines = sorted(ln for ln in text.splitlines() if ln.strip())
    assert lines == [f"0 2 {host}", f"1 2 {host}"], text
    info = job_info(job, env)
    assert info is not None and info["ExitCode"] == "0:0"
    print(f"cluster up in {env['LOCAL_SLURM_STARTUP_SECONDS']}s, job took {elapsed:.1f}s")


def env_host(env) -> str:
    res = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], env=env, capture_output=True, text=True, check=True)
    return res.stdout.strip()


def test_new_step_after_failed_step(slurm):
    env, tmp = slurm
    out = tmp / "steps.out"
    script = _write_script(
        tmp / "steps.sbatch",
        f"""
        #!/bin/bash
        #SBATCH --job-name=steps
        #SBATCH --ntasks=2
        #SBATCH --output={out}
        #SBATCH --time=2
        # step 0: its only task exits 1
        srun --ntasks=1 --kill-on-bad-exit=0 bash -c 'exit 1'
        echo "step0 rc=$?"
        # step 1: task 0 is SIGKILLed, task 1 keeps running and finishes
        # (with --kill-on-bad-exit=1 task 1 would be terminated instead)
        srun --ntasks=2 --kill-on-bad-exit=0 bash -c \\
            'if [ "$SLURM_PROCID" = 0 ]; then sleep 0.3; kill -9 $$; fi; sleep 2; echo "survivor $SLURM_PROCID"'
        echo "step1 rc=$?"
        # step 2: the allocation is still usable
        srun --ntasks=2 --kill-on-bad-exit=0 {PY} -c {PRINT_STEP}
        echo "step2 rc=$?"
        """,
    )
    job = sbatch(script, env, f"--chdir={tmp}")
    state = wait_job(job, env, timeout=45)
    text = _read(out)
    assert state == "COMPLETED", text
    assert "step0 rc=1" in text, text
    m = re.search(r"step1 rc=(\d+)", text)
    assert m and m.group(1) != "0", text
    assert "survivor 1" in text, text
    assert "survivor 0" not in text, text
    assert "step2 task 0 2" in text and "step2 task 1 2" in text, text
    assert "step2 rc=0" in text, text
    assert "step1 rc=137" in text, text  # 128 + SIGKILL


def _requeue_script(path: Path, out: Path, marker: Path, extra_sbatch: str = "") -> Path:
    return _write_script(
        path,
        f"""
        #!/bin/bash
        #SBATCH --job-name=requeue
        #SBATCH --ntasks=1
        #SBATCH --output={out}
        #SBATCH --open-mode=append
        #SBATCH --requeue
        {extra_sbatch}
        echo "run restart=${{SLURM_RESTART_COUNT:-0}}"
        if [ "${{SLURM_RESTART_COUNT:-0}}" -ge 1 ]; then
            echo "second run done"
            exit 0
        fi
        on_term() {{
            # `scontrol requeue` makes SLURM signal this very shell again
            # (SIGTERM, then SIGKILL after KillWait): ignore further TERMs so
            # the handler is not re-entered, and requeue as the last action.
            trap '' TERM
            echo "got SIGTERM"
            kill %1 2>/dev/null
            scontrol requeue "$SLURM_JOB_ID"
            echo "requeue rc=$?"
            exit 0
        }}
        trap on_term TERM
        touch {marker}
        sleep 300 &
        wait
        """,
    )


def test_sigterm_then_requeue(slurm):
    env, tmp = slurm
    out = tmp / "requeue.out"
    marker = tmp / "started"
    script = _requeue_script(tmp / "requeue.sbatch", out, marker, "#SBATCH --time=2")
    job = sbatch(script, env, f"--chdir={tmp}")
    wait_for(marker.exists, timeout=30, what="first run to start")
    subprocess.run(["scancel", "--batch", "--signal=TERM", job], env=env, check=True, timeout=15)
    state = wait_job(job, env, timeout=45)
    text = _read(out)
    assert state == "COMPLETED", text
    assert "run restart=0" in text and "requeue rc=0" in text, text
    assert text.count("got SIGTERM") == 1, text
    assert "run restart=1" in text and "second run done" in text, text
    info = job_info(job, env)
    assert info is not None and info["Restarts"] == "1", info


def test_time_limit_signal_then_requeue(slurm):
    """``#SBATCH --signal=B:TERM@58`` with a 1-minute limit: the batch shell is
    signalled on slurmctld's next time-limit check (it runs every ~30 s, so this
    takes 2-35 s), requeues itself and runs again."""
    env, tmp = slurm
    out = tmp / "tl.out"
    marker = tmp / "tl-started"
    script = _requeue_script(tmp / "tl.sbatch", out, marker, "#SBATCH --time=1 --signal=B:TERM@58")
    t0 = time.monotonic()
    job = sbatch(script, env, f"--chdir={tmp}")
    state = wait_job(job, env, timeout=75)
    text = _read(out)
    assert state == "COMPLETED", text
    assert text.count("got SIGTERM") == 1 and "requeue rc=0" in text, text
    assert "run restart=1" in text and "second run done" in text, text
    print(f"time-limit signal + requeue took {time.monotonic() - t0:.1f}s")


def test_teardown_kills_running_jobs(tmp_path: Path):
    _require_slurm()
    started = tmp_path / "started"
    script = _write_script(
        tmp_path / "long.sbatch",
        f"""
        #!/bin/bash
        #SBATCH --ntasks=2
        #SBATCH --output={tmp_path}/long.out
        srun bash -c 'touch {started}.$SLURM_PROCID; trap "" TERM; sleep 600'
        """,
    )
    with local_slurm(tmp_path / "slurm", cpus=4) as env:
        job = sbatch(script, env, f"--chdir={tmp_path}")
        wait_for(lambda: all((tmp_path / f"started.{i}").exists() for i in range(2)), timeout=30, what="tasks")
        assert len(cluster_pids(env)) >= 4  # stepds + tasks
        assert job_info(job, env)["JobState"] == "RUNNING"
    assert cluster_pids(env) == []
