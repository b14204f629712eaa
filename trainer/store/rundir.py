"""The run dir's files: their names, and the one way every writer replaces one (atomically).

A file that a kill may catch half-written (heartbeats, runbook.json, summary.json, the data cache) is
written to a temporary name and renamed over the old one: readers see the old bytes or the new ones.
Every JSON we write is strict (RFC 8259): a NaN or infinite float is written as null.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
from pathlib import Path

from trainer.config import ConfigError

# Everything directly under a run dir (the checkpoint folders: trainer.store.ckpt_files).
EVENTS = "events.jsonl"
SUMMARY = "summary.json"
CONFIG = "config.yaml"  # the resolved config
RUNBOOK = "runbook.json"  # the spike runbook's state: skipped batches, softened hyperparameters
FAULTS_FIRED = "faults_fired.json"  # the injected faults that have fired, so a restart does not fire them again
FAULT_LOG = "faults.jsonl"  # each injected fault as it fires: index, kind, step, process, time (for the drill)
TENSORBOARD = "tb"
TB_HOSTS = "hosts"  # under TENSORBOARD: one run per process other than 0, its host's health and alerts
HEARTBEAT = "heartbeat"  # worker-PROCESS.json: phase and step; pulse-PROCESS.json: alive; supervisor.json: lease
STACKS = "stacks"  # worker-PID.txt: a hung worker's Python stacks, dumped before the kill
LOGS = "logs"  # worker-ATTEMPT.log: each attempt's output, as the supervisor saw it
AUDIT = "audit"  # process-I.jsonl: the data each process consumed (data.audit)
REPORT = "report"  # the end-of-run report: REPORT_MD and its plots
REPORT_MD = "report.md"
SUSPECT_NODES = "suspect_nodes.json"  # SLURM nodes the supervisor blamed for a failure, and why


def check_writable(run_dir: str | Path) -> None:
    """Refuse, as a ConfigError, a run.dir that cannot be created or written, before anything is written."""
    p = Path(run_dir)
    if p.exists() and not p.is_dir():
        raise ConfigError(
            f"run.dir {p} is an existing file, not a directory; pick another run.dir (--set run.dir=runs/NAME)"
        )
    base = p
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise ConfigError(f"run.dir {p} cannot be created: {base} is a file, not a directory; pick another run.dir")
    if not os.access(base, os.W_OK | os.X_OK):
        what = f"run.dir {p} is" if base == p else f"run.dir {p} cannot be created: {base} is"
        raise ConfigError(
            f"{what} not writable by this user; pick a run.dir you can write "
            f"(--set run.dir=runs/NAME) or fix its permissions"
        )


def stack_file(run_dir: str | Path, pid: int | str) -> Path:
    """Where the worker process `pid` dumps its Python stacks (pid "*": the glob of them all)."""
    return Path(run_dir) / STACKS / f"worker-{pid}.txt"


def drop_empty_stacks(run_dir: Path, pids: list[int] | None = None) -> None:
    """Remove the stack files of workers (all, or those `pids`) that never had to dump: every worker opens
    one at start, because faulthandler needs the file before a hang, but only a hang fills it."""
    folder = Path(run_dir) / STACKS
    names = [stack_file(run_dir, pid).name for pid in pids] if pids is not None else None
    try:  # peers of a process group tidy up at the same moment: whatever one of them removed is gone
        for f in folder.glob(stack_file(run_dir, "*").name):
            if (names is None or f.name in names) and f.stat().st_size == 0:
                f.unlink(missing_ok=True)
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
    except OSError:
        pass


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


def _finite(obj):
    """`obj` with every NaN/Inf float replaced by None: Python's json would write the non-standard
    NaN/Infinity tokens, which strict parsers (jq, browsers, Go, Rust) reject."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def dumps(obj, *, indent: int | None = None) -> str:
    """Strict JSON text of `obj` (non-finite floats as null): the one encoder of every JSON file we write."""
    return json.dumps(_finite(obj), indent=indent, allow_nan=False)


def write_json(path: Path, obj, *, durable: bool = False, indent: int | None = 1) -> None:
    atomic_write(path, dumps(obj, indent=indent), durable=durable)


def read_json(path: Path) -> dict | None:
    """The file's JSON object, or None when it is missing or unreadable (torn by a kill, say)."""
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def lock(run_dir: Path) -> int | None:
    """One supervisor per run dir: an flock on the directory itself (its fd, or None: held by another). The
    kernel releases it when the holder dies, so a stale lock from a dead supervisor is simply taken over."""
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd
