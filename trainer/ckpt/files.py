"""Checkpoints as files on disk, for everyone who reads them without Orbax (the worker's tiers, the
`checkpoints` and `status` commands, export, the runbook): where each tier lives, which steps are committed
and sealed, the items of a step, and the folders rejected or rewound checkpoints are moved aside to.
No jax.

A step directory is committed once it carries its step number as its name: Orbax writes into a temporary
name and renames it into place when complete. It is sealed once every writing process's content manifest
is in it (trainer.ckpt.manifest).
"""

from __future__ import annotations

import glob
import hashlib
from pathlib import Path

from trainer.ckpt import manifest

DURABLE, LOCAL = "durable", "local"  # the tiers: shared storage (all processes, one checkpoint), node-local
ITEMS = ("state", "data", "meta")  # Orbax items of a step: train state, data cursor, metadata (JSON)
BUDDY = "buddy"  # a local step's extra item: the shards of another process (on another node), held for it
CHECKPOINTS = "checkpoints"  # RUN_DIR/checkpoints: the durable tier
REJECTED = "rejected_checkpoints"  # RUN_DIR/...: checkpoints that failed verification or loading, for a post-mortem
REWOUND = "rewound"  # RUN_DIR/...: checkpoints the spike runbook rewound away from
LOCAL_REJECTED = "rejected"  # beside the local tier's process folders: its rejected copies


def durable_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


NODE = "{node}"  # in checkpoint.local_dir: the node's name (for nodes that share one file system, and tests)


def local_root(local_dir: str, run_dir: str | Path, node: str = "") -> Path:
    """This run's part of a node-local checkpoint directory (checkpoint.local_dir, with {node} replaced by
    `node`): runs sharing one RAM disk never see each other's checkpoints. Each process keeps its own
    `process_<i>/` below it."""
    run = Path(run_dir).resolve()
    base = Path(local_dir.replace(NODE, node)).expanduser()
    return base / f"{run.name}-{hashlib.sha256(str(run).encode()).hexdigest()[:8]}"


def local_dir(local_dir: str, run_dir: str | Path, process: int, node: str = "") -> Path:
    """One process's local tier."""
    return local_root(local_dir, run_dir, node) / f"process_{process}"


def local_dirs(local_dir: str, run_dir: str | Path, node: str | None = None) -> list[Path]:
    """Every process folder of the local tier on this machine (other nodes' are theirs to list); with
    {node} in local_dir and no `node`, those of every node whose folder this machine sees."""
    if node is None and NODE in local_dir:
        roots = [Path(r) for r in glob.glob(str(local_root(local_dir, run_dir, "*")))]
    else:
        roots = [local_root(local_dir, run_dir, node or "")]
    return sorted(p for root in roots for p in root.glob("process_*") if p.is_dir())


def committed_steps(directory: str | Path) -> list[int]:
    """The committed steps of one tier's directory, oldest first ([] when it does not exist)."""
    try:
        return sorted(int(p.name) for p in Path(directory).iterdir() if p.name.isdigit())
    except OSError:
        return []


def sealed_steps(directory: str | Path) -> list[int]:
    """The committed steps whose manifests are all present, oldest first."""
    return [s for s in committed_steps(directory) if manifest.sealed(Path(directory) / str(s))]


def is_step_dir(path: str | Path) -> bool:
    """A path that names one checkpoint: a step directory holding the state item."""
    path = Path(path)
    return path.name.isdigit() and (path / ITEMS[0]).is_dir()


def rejected_path(run_dir: str | Path, step: int, stamp: int) -> Path:
    """Where a rejected durable checkpoint goes (`stamp` keeps a step rejected twice apart)."""
    return Path(run_dir) / REJECTED / f"{step}-{stamp}"


def local_rejected_path(tier_dir: Path, step: int, stamp: int) -> Path:
    """Where a process's rejected local checkpoint goes, beside the process folders of the local tier."""
    return tier_dir.parent / LOCAL_REJECTED / f"{tier_dir.name}-{step}-{stamp}"


def rewound_path(run_dir: str | Path, step: int, tag: int) -> Path:
    """Where a checkpoint the runbook rewound away from goes (`tag`: the rewind's)."""
    return Path(run_dir) / REWOUND / f"{step}-{tag}"
