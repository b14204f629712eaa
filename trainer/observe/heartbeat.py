"""Worker heartbeats: a tiny JSON file per process with step, phase and time, replaced atomically.

The worker writes them; the supervisor (which never imports jax) reads them to tell a slow phase from a
hang, and `status` to show the last beat and whether it is overdue. A run-dir record, so it lives in observe.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from trainer.config import SupervisorConfig
from trainer.observe import env_vars, rundir
from trainer.observe.events import NO_SPACE
from trainer.observe.rundir import read_json, write_json

PHASES = ("startup", "restore", "compile", "step", "eval", "checkpoint", "done")


def phase_timeout(sc: SupervisorConfig, phase: str) -> float:
    """How long a worker may stay silent in `phase` before it counts as hung."""
    return {
        "startup": sc.startup_timeout_s,
        "compile": sc.startup_timeout_s,
        "restore": sc.restore_timeout_s,
        "checkpoint": sc.checkpoint_timeout_s,
        "eval": sc.eval_timeout_s,
        "done": sc.checkpoint_timeout_s,
    }.get(phase, sc.step_timeout_s)


def heartbeat_path(run_dir: Path, process: int) -> Path:
    return Path(run_dir) / rundir.HEARTBEAT / f"worker-{process}.json"


class Heartbeat:
    def __init__(self, run_dir: Path, process: int, *, data: str = ""):
        self.path = heartbeat_path(run_dir, process)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.data = data  # the fingerprint of the data this process reads: every process's is on record

    def beat(self, phase: str, step: int) -> None:
        # "launch" names the attempt (set by the supervisor), so a stale file from an old attempt never counts.
        try:
            write_json(
                self.path,
                {
                    "phase": phase,
                    "step": step,
                    "time": time.time(),
                    "pid": os.getpid(),
                    "launch": os.environ.get(env_vars.LAUNCH_ID, ""),
                    "data": self.data,
                },
                indent=None,
            )
        except OSError as e:  # a full disk: the last beat stays; a real hang is still caught by its age
            if e.errno not in NO_SPACE:
                raise


def read(path: Path) -> dict | None:
    """The heartbeat, or None when it is missing, torn or damaged: a reader treats it as not written yet."""
    hb = read_json(path)
    if (
        hb is None
        or hb.get("phase") not in PHASES
        or not all(isinstance(hb.get(k), (int, float)) and not isinstance(hb.get(k), bool) for k in ("step", "time"))
    ):
        return None
    return hb
