"""Worker heartbeats: a tiny JSON file per process with step, phase and time, replaced atomically.

The supervisor (which never imports jax) reads them to tell a slow phase from a hang.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

PHASES = ("startup", "restore", "compile", "step", "checkpoint", "done")


def heartbeat_path(run_dir: Path, process: int) -> Path:
    return Path(run_dir) / "heartbeat" / f"worker-{process}.json"


class Heartbeat:
    def __init__(self, run_dir: Path, process: int):
        self.path = heartbeat_path(run_dir, process)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.path.with_suffix(f".tmp{os.getpid()}")

    def beat(self, phase: str, step: int) -> None:
        # "launch" names the attempt (set by the supervisor), so a stale file from an old attempt never counts.
        self._tmp.write_text(json.dumps({"phase": phase, "step": step, "time": time.time(), "pid": os.getpid(),
                                         "launch": os.environ.get("TRAINER_LAUNCH_ID", "")}))
        os.replace(self._tmp, self.path)


def read(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
