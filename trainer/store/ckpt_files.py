"""Checkpoints as files on disk, for everyone who reads them without Orbax (the worker's tiers, the
`checkpoints` and `status` commands, export, the runbook): where each tier lives, which steps are committed
and sealed, the items of a step, and the folders rejected or rewound checkpoints are moved aside to.
No jax.

A step directory is committed once it carries its step number as its name: Orbax writes into a temporary
name and renames it into place when complete. It is sealed once every writing process's content manifest
is in it (trainer.store.manifest).
"""

from __future__ import annotations

import glob
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from trainer.store import manifest, rundir
from trainer.yamltree import read_yaml

DURABLE, LOCAL = "durable", "local"  # the tiers: shared storage (all processes, one checkpoint), node-local
# The Orbax items of a step, each a folder in the step directory:
STATE = "state"  # the train state: params, optimizer state, step, PRNG key
DATA = "data"  # the data cursor (JSON): the next batch's index
META = "meta"  # the metadata (JSON): config, data fingerprint, mesh, processes, versions (`Meta` below)
BUDDY = "buddy"  # a local step's extra item: the shards of another process (on another node), held for it
ITEMS = (STATE, DATA, META)  # what every step holds
META_FILE = "metadata"  # the file of the META item, as Orbax's JSON handler names it
CHECKPOINTS = "checkpoints"  # RUN_DIR/checkpoints: the durable tier
REJECTED = "rejected_checkpoints"  # RUN_DIR/...: checkpoints that failed verification or loading, for a post-mortem
REWOUND = "rewound"  # RUN_DIR/...: checkpoints the spike runbook rewound away from
LOCAL_REJECTED = "rejected"  # beside the local tier's process folders: its rejected copies


def durable_dir(run_dir: str | Path, configured: str | None = None) -> Path:
    """The durable tier's directory: checkpoint.durable_dir when set to a path (another file system than the
    run dir's, e.g. a scratch file system beside a home directory), else RUN_DIR/checkpoints (with a bucket:
    its staging directory, `durable_url`). `configured`: the config's value,
    from a caller that holds the config (the worker, before it writes RUN_DIR/config.yaml); None: read from
    RUN_DIR/config.yaml, for those that know only the run dir (the supervisor, status, the runbook)."""
    if configured is None:
        configured = saved_durable_dir(run_dir)
    if not configured or "://" in configured:  # a bucket's steps are staged in RUN_DIR/checkpoints
        return Path(run_dir) / CHECKPOINTS
    return Path(configured).expanduser()


def durable_url(run_dir: str | Path, configured: str | None = None) -> str | None:
    """checkpoint.durable_dir when it is a bucket (s3://, gs://: trainer.store.bucket), else None."""
    if configured is None:
        configured = saved_durable_dir(run_dir)
    return configured if "://" in (configured or "") else None


def saved_durable_dir(run_dir: str | Path) -> str:
    """checkpoint.durable_dir as RUN_DIR/config.yaml records it ("" when unset, or no run yet). Read at each
    call: it is small, and callers ask a few times a command or once a poll. observe.runview.saved_config
    reads the same file for the observers; this module sits below them."""
    path = Path(run_dir) / rundir.CONFIG
    if not path.is_file():  # no run yet, or RUN_DIR is not a directory (refused later, with its own line)
        return ""
    tree = read_yaml(str(path))
    return str((tree.get("checkpoint") or {}).get("durable_dir") or "")


def aside_dir(run_dir: str | Path, name: str, configured: str | None = None) -> Path:
    """Where durable checkpoints moved aside go (`name`: REJECTED, REWOUND), on the durable tier's own file
    system (a rename cannot cross one): RUN_DIR/NAME beside the default RUN_DIR/checkpoints, else
    DURABLE_DIR-NAME beside checkpoint.durable_dir."""
    durable = durable_dir(run_dir, configured)
    default = durable == Path(run_dir) / CHECKPOINTS
    return Path(run_dir) / name if default else durable.parent / f"{durable.name}-{name}"


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
    return path.name.isdigit() and (path / STATE).is_dir()


@dataclass(frozen=True)
class Meta:
    """A step's metadata item, read once per restore (`read_meta`) and passed on: what the loop saved beside
    the state (config, data fingerprint, mesh, processes, versions, runtime, init_from; trainer.train.loop)
    and what the tiers add (lineage; in a local step also holds, node, process). Readers use the properties;
    `record` stays the item as saved, for those that check it whole (the resume checks, export)."""

    step_dir: Path  # where it was read (a local restore: the copy one process read for all)
    record: dict  # the item as saved

    @property
    def step(self) -> int:
        return int(self.step_dir.name)

    @property
    def processes(self) -> int | None:
        """How many processes saved it (None: not recorded, so no layout matches it)."""
        return self.record.get("processes")

    @property
    def mesh(self) -> dict[str, int] | None:
        """The mesh it was saved under, axis name -> size (None: not recorded, so no layout matches it)."""
        return self.record.get("mesh")

    @property
    def init_from(self) -> dict | None:
        """Where the run's params started (train.init_from's checkpoint), kept through resumes; None: fresh."""
        return self.record.get("init_from")

    @property
    def lineage(self) -> int:
        """How many runbook rewinds the run had been through when it saved this step."""
        return int(self.record.get("lineage", 0))

    @property
    def holds(self) -> int | None:
        """A local step: the process whose shards it also holds (its BUDDY item); None: none."""
        return None if self.record.get("holds") is None else int(self.record["holds"])


def read_meta(step_dir: str | Path) -> Meta:
    """A step's metadata item, read as this process alone (no Orbax manager: no barrier with the others).
    Orbax's JSON handler writes it as one file; a torn or missing one raises."""
    step_dir = Path(step_dir).absolute()
    return Meta(step_dir, json.loads((step_dir / META / META_FILE).read_text()))


def rejected_path(run_dir: str | Path, step: int, stamp: int, configured: str | None = None) -> Path:
    """Where a rejected durable checkpoint goes (`stamp` keeps a step rejected twice apart)."""
    return aside_dir(run_dir, REJECTED, configured) / f"{step}-{stamp}"


def local_rejected_path(tier_dir: Path, step: int, stamp: int) -> Path:
    """Where a process's rejected local checkpoint goes, beside the process folders of the local tier."""
    return tier_dir.parent / LOCAL_REJECTED / f"{tier_dir.name}-{step}-{stamp}"


def rewound_path(run_dir: str | Path, step: int, tag: int) -> Path:
    """Where a checkpoint the runbook rewound away from goes (`tag`: the rewind's)."""
    return aside_dir(run_dir, REWOUND) / f"{step}-{tag}"
