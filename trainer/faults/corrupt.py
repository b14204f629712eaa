"""The `corrupt` fault: what storage or a kill can do to a checkpoint after it was committed, done to the newest
sealed checkpoint just before the worker crashes: the one its restart reads first (the fast tier's copy, at a
step both tiers hold or a newer one). The restart must reject that checkpoint (its manifest's checksums, or
Orbax failing to read it), set it aside and resume from another copy or the one before.
"""

from __future__ import annotations

from pathlib import Path

from trainer.config import CORRUPT_HOW
from trainer.store import ckpt_files as checkpoint_files
from trainer.store.ckpt_files import META, META_FILE, STATE


def largest_file(directory: Path) -> Path:
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def flip(step_dir: Path, item: str = STATE) -> str:
    """A few bytes flipped in the middle of the item's largest file (silent media corruption: the file still
    reads, only its checksum says it changed). Returns the file, relative to the step dir."""
    f = largest_file(step_dir / item)
    b = bytearray(f.read_bytes())
    for i in range(len(b) // 2, len(b) // 2 + 8):
        b[i] ^= 0x5A
    f.write_bytes(bytes(b))
    return f.relative_to(step_dir).as_posix()


def truncate(step_dir: Path) -> str:
    """The state's largest file cut to a third (a copy or a filesystem that lost its tail)."""
    f = largest_file(step_dir / STATE)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    return f.relative_to(step_dir).as_posix()


def torn(step_dir: Path) -> str:
    """The step's metadata item cut in half (a restart that did not reject it would fail on it every time)."""
    f = step_dir / META / META_FILE
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return f"{META}/{META_FILE}"


HOW = {how: globals()[how] for how in CORRUPT_HOW}  # each kind a config may name is the function of its name


def newest(run_dir: Path, how: str, local: Path | None = None) -> str:
    """Corrupt the newest sealed checkpoint of the run `how` says: the durable tier's, or this process's fast-tier
    folder's (`local`) when it holds that step or a newer one. Returns what was hit ("" when the run has no
    sealed checkpoint yet: then there is nothing to corrupt and the fault is only a crash)."""
    roots = [checkpoint_files.durable_dir(run_dir), *([local] if local is not None else [])]
    found = [(s, i, root) for i, root in enumerate(roots) for s in checkpoint_files.sealed_steps(root)[-1:]]
    if not found:
        return ""
    step, tier, root = max(found)  # at one step the local copy (restored first)
    hit = f"{step}/{HOW[how](root / str(step))}"
    return f"local:{hit}" if tier else hit
