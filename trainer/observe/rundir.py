"""The run dir's files: their names, and the one way every writer replaces one (atomically).

A file that a kill may catch half-written (heartbeats, runbook.json, summary.json, the data cache) is
written to a temporary name and renamed over the old one: readers see the old bytes or the new ones.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

EVENTS = "events.jsonl"
SUMMARY = "summary.json"
CONFIG = "config.yaml"
CHECKPOINTS = "checkpoints"
TENSORBOARD = "tb"
REJECTED = "rejected_checkpoints"  # checkpoints that failed verification or loading, kept for a post-mortem


def local_root(local_dir: str, run_dir: Path) -> Path:
    """This run's part of a node-local checkpoint directory (checkpoint.local_dir): runs sharing one RAM disk
    never see each other's checkpoints. Each process keeps its own `process_<i>/` below it."""
    run = Path(run_dir).resolve()
    return Path(local_dir).expanduser() / f"{run.name}-{hashlib.sha256(str(run).encode()).hexdigest()[:8]}"


def atomic_write(path: Path, data: str | bytes, *, durable: bool = False) -> None:
    """Replace `path` with `data` in one rename. The temporary name carries the pid, so processes
    racing on the same file never write into each other's temporary file. `durable` fsyncs first:
    for state a restart must find (runbook decisions, fired faults), not for what is rewritten soon."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data.encode() if isinstance(data, str) else data)
        if durable:
            fh.flush()
            os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_json(path: Path, obj, *, durable: bool = False, indent: int | None = 1) -> None:
    atomic_write(path, json.dumps(obj, indent=indent), durable=durable)


def read_json(path: Path) -> dict | None:
    """The file's JSON object, or None when it is missing or unreadable (torn by a kill, say)."""
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None
