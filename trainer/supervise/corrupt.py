"""The `corrupt` fault: what storage or a kill can do to a checkpoint after it was committed, done to the newest
sealed durable checkpoint just before the worker crashes. Its restart must reject that checkpoint (its
manifest's checksums, or Orbax failing to read it), set it aside and resume from the one before.
"""

from __future__ import annotations

from pathlib import Path

from trainer.observe import checkpoint_files


def largest_file(directory: Path) -> Path:
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def flip(step_dir: Path, item: str = "state") -> str:
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
    f = largest_file(step_dir / "state")
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    return f.relative_to(step_dir).as_posix()


def torn(step_dir: Path) -> str:
    """The step's metadata item cut in half (what a run once crash-looped on, every restart)."""
    f = step_dir / "meta" / "metadata"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return "meta/metadata"


HOW = {"flip": flip, "truncate": truncate, "torn": torn}


def newest(run_dir: Path, how: str) -> str:
    """Corrupt the newest sealed durable checkpoint of the run `how` says; returns what was hit ("" when the
    run has no sealed checkpoint yet: then there is nothing to corrupt and the fault is only a crash)."""
    root = checkpoint_files.durable_dir(run_dir)
    steps = checkpoint_files.sealed_steps(root)
    if not steps:
        return ""
    return f"{steps[-1]}/{HOW[how](root / str(steps[-1]))}"
