"""`python -m trainer checkpoints RUN_DIR [--verify]`: every checkpoint of a run with its step, tier, size,
age and whether its content manifests are complete; `--verify` re-reads every file against its checksum.
No jax: it works on a login node, or while the run goes on.

The local tier is listed from this machine's `checkpoint.local_dir` (from RUN_DIR/config.yaml): other
nodes' local checkpoints are theirs to list.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from trainer.config import ConfigError
from trainer.observe import runview
from trainer.observe.progress import fmt_duration
from trainer.store import ckpt_files as checkpoint_files
from trainer.store import manifest


@dataclass
class Entry:
    step: int
    tier: str  # durable | local (process i)
    path: str
    bytes: int
    age_s: float
    verified: bool  # all manifests present (and, with --verify, every file matches them)
    detail: str


def _local_dirs(run_dir: Path) -> list[tuple[str, Path]]:
    try:
        cfg = runview.saved_config(run_dir) or {}
    except ConfigError:
        return []
    local = (cfg.get("checkpoint") or {}).get("local_dir") or ""
    if not local:
        return []
    return [(f"local ({p.name.replace('_', ' ')})", p) for p in checkpoint_files.local_dirs(local, run_dir)]


def _bucket_entries(url: str, *, verify: bool) -> list[Entry]:
    """The durable tier in a bucket: its steps as the bucket lists them, checked there (nothing downloaded to
    disk; --verify reads every object once)."""
    from trainer.store import bucket

    b, out = bucket.Bucket(url), []
    for step in reversed(list(b.steps())):
        found, problems = b.manifests(step)
        n = sum(len(m["files"]) for m in found.values())
        if problems:
            ok, detail = False, problems[0].reason + (f" ({problems[0].file})" if problems[0].file else "")
        elif verify and (bad := b.verify(step)) is not None:
            ok, detail = False, f"BAD {bad.file}: {bad.reason}"
        else:
            ok, detail = True, f"ok: {n} files match" if verify else f"sealed: {len(found)} manifest(s), {n} files"
        size = sum(int(f["bytes"]) for m in found.values() for f in m["files"].values())
        age = time.time() - max((float(m.get("time", 0)) for m in found.values()), default=time.time())
        out.append(Entry(step, checkpoint_files.DURABLE, f"{b.loc}{step}", size, age, ok, detail))
    return out


def entries(run_dir: Path, *, verify: bool) -> list[Entry]:
    out = []
    dirs = [(checkpoint_files.DURABLE, checkpoint_files.durable_dir(run_dir))] + _local_dirs(run_dir)
    if url := checkpoint_files.durable_url(run_dir):  # the bucket's, not the staging directory's copies
        out, dirs = _bucket_entries(url, verify=verify), dirs[1:]
    for tier, d in dirs:
        for step in reversed(checkpoint_files.committed_steps(d)):
            step_dir = d / str(step)
            files = [p for p in step_dir.rglob("*") if p.is_file()]
            found, problems = manifest.read(step_dir)
            if problems:
                ok, detail = False, f"{problems[0].reason}" + (f" ({problems[0].file})" if problems[0].file else "")
            else:
                n = sum(len(m["files"]) for m in found.values())
                ok, detail = True, f"sealed: {len(found)} manifest(s), {n} files"
                if verify and (bad := manifest.verify(step_dir)) is not None:
                    ok, detail = False, f"BAD {bad.file}: {bad.reason}"
                elif verify:
                    detail = f"ok: {n} files match"
            newest = max((p.stat().st_mtime for p in files), default=step_dir.stat().st_mtime)
            out.append(
                Entry(step, tier, str(step_dir), sum(p.stat().st_size for p in files), time.time() - newest, ok, detail)
            )
    return out


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer checkpoints", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="the run.dir of a run")
    p.add_argument("--verify", action="store_true", help="re-read every file and compare it with its checksum")
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"error: {run_dir} is not a directory; pass a run dir (the run.dir of a run)", file=sys.stderr)
        return 2
    found = entries(run_dir, verify=args.verify)
    if args.json:
        print(json.dumps([asdict(e) for e in found]))
    elif not found:
        print(f"{run_dir}: no checkpoints")
    else:
        print(f"{'step':>8}  {'tier':<18} {'size':>9}  {'age':>8}  {'verified' if args.verify else 'manifests'}")
        for e in found:
            print(f"{e.step:>8}  {e.tier:<18} {_size(e.bytes):>9}  {fmt_duration(e.age_s):>8}  {e.detail}")
        aside = run_dir / checkpoint_files.REJECTED
        if aside.is_dir() and (n := len(list(aside.iterdir()))):
            print(f"{n} rejected checkpoint(s) kept in {aside}")
    return 1 if args.verify and not all(e.verified for e in found) else 0
