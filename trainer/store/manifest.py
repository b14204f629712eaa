"""Content checksums of checkpoints, end to end: after a save commits, each process writes a manifest of
the files it committed (size and sha256) into the step directory (`integrity/process_<i>.json`, atomic);
before a restore the files are read back and compared. A checkpoint without all its manifests is
unverified. No jax: `python -m trainer checkpoints --verify` and the supervisor use this too.

Which process committed which file: Orbax gives each process its own `ocdbt.process_<i>/` and
`array_metadatas/process_<i>`; everything else (index, metadata items, commit markers) is process 0's.
"""

from __future__ import annotations

import errno
import hashlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from trainer.store.rundir import atomic_write

DIR = "integrity"
_PER_PROCESS = re.compile(r"(?:^|/)(?:ocdbt\.)?process_(\d+)(?:/|$)")
_CHUNK = 8 << 20
# Errors a retry may cure: a flaky network filesystem, an overloaded server. Anything else (a missing
# file, a checksum mismatch, a torn item) is the checkpoint's own fault.
_TRANSIENT_ERRNOS = {
    errno.EIO,
    errno.ETIMEDOUT,
    errno.EAGAIN,
    errno.EINTR,
    errno.ESTALE,
    errno.EBUSY,
    errno.ENETDOWN,
    errno.ENETUNREACH,
    errno.ECONNRESET,
    errno.ECONNABORTED,
}
_TRANSIENT_WORDS = ("DEADLINE_EXCEEDED", "UNAVAILABLE", "timed out", "Timed out")
RETRIES, RETRY_WAIT_S = 3, 1.0  # a possibly transient read error is retried 3 times, after 1, 2 and 4 s
T = TypeVar("T")


@dataclass(frozen=True)
class Problem:
    """Why a checkpoint cannot be trusted: the file (relative to the step dir; "" = the whole checkpoint)."""

    file: str
    reason: str


def manifest_path(step_dir: Path, process: int) -> Path:
    return Path(step_dir) / DIR / f"process_{process}.json"


def owner(rel: str, processes: int) -> int:
    m = _PER_PROCESS.search(rel)
    return int(m.group(1)) if m and processes > 1 else 0


def committed_files(step_dir: Path, process: int, processes: int) -> list[str]:
    """The files of a committed step dir that `process` wrote (relative paths, sorted)."""
    step_dir = Path(step_dir)
    rels = (p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*") if p.is_file())
    return sorted(r for r in rels if not r.startswith(DIR + "/") and owner(r, processes) == process)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)  # hashlib drops the GIL on large buffers: the training thread runs meanwhile
    return h.hexdigest()


def write(step_dir: Path, *, process: int, processes: int, durable: bool) -> dict:
    """Checksum what this process committed and record it, atomically, inside the checkpoint."""
    step_dir = Path(step_dir)
    files = {
        rel: {"bytes": (step_dir / rel).stat().st_size, "sha256": sha256_file(step_dir / rel)}
        for rel in committed_files(step_dir, process, processes)
    }
    rec = {"version": 1, "process": process, "processes": processes, "time": time.time(), "files": files}
    (step_dir / DIR).mkdir(exist_ok=True)
    atomic_write(manifest_path(step_dir, process), json.dumps(rec), durable=durable)
    return rec


def read(step_dir: Path) -> tuple[dict[int, dict], list[Problem]]:
    """All manifests of a step dir, and what is wrong with the set (none, missing, torn)."""
    try:
        paths = sorted((Path(step_dir) / DIR).glob("process_*.json"))
    except OSError:  # the step dir went while it was listed (retention deleted it): nothing sealed there
        paths = []
    return judge({p.name: p.read_text for p in paths})


def judge(
    loaders: dict[str, Callable[[], str | bytes]], *, unfinished: str = "sealing"
) -> tuple[dict[int, dict], list[Problem]]:
    """A step's manifests by file name, each read by its loader (from a directory, or from a bucket:
    trainer.store.bucket), and what is wrong with the set: none, one missing, one torn. `unfinished`: what a
    step with none did not finish."""
    found: dict[int, dict] = {}
    problems: list[Problem] = []
    for name, load in sorted(loaders.items()):
        try:
            rec = json.loads(load())
            found[int(rec["process"])] = rec
        except (OSError, ValueError, KeyError, TypeError):
            problems.append(Problem(f"{DIR}/{name}", "manifest unreadable (torn or corrupt)"))
    if not loaders:
        return found, [Problem("", f"unverified: no content manifest (the save did not finish {unfinished})")]
    expected = max((int(r.get("processes", 1)) for r in found.values()), default=1)
    problems += [
        Problem(f"{DIR}/process_{i}.json", f"unverified: manifest of process {i} missing")
        for i in range(expected)
        if i not in found and not any(f"process_{i}." in q.file for q in problems)
    ]
    return found, problems


def sealed(step_dir: Path) -> bool:
    """Every manifest present and readable (contents not re-checked): the retention pin's test."""
    return not read(step_dir)[1]


def is_transient(e: BaseException) -> bool:
    """Whether an error may go away on a retry; looks through the exception's causes."""
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, TimeoutError) or (isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS):
            return True
        if any(w in str(e) for w in _TRANSIENT_WORDS):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def retrying(
    fn: Callable[[], T],
    *,
    retries: int = RETRIES,
    wait_s: float = RETRY_WAIT_S,
) -> T:
    """fn(), retried `retries` times with doubling waits when it fails with a possibly transient error."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except Exception as e:
            if attempt == retries or not is_transient(e):
                raise
            time.sleep(wait_s * 2**attempt)
    raise AssertionError("unreachable")


def _check(step_dir: Path, rel: str, want: dict) -> Problem | None:
    path = Path(step_dir) / rel
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return Problem(rel, "file missing")
    if size != want["bytes"]:
        return Problem(rel, f"size {size} bytes, {want['bytes']} when saved (truncated or torn)")
    if sha256_file(path) != want["sha256"]:
        return Problem(rel, "content checksum mismatch (bytes changed since the save)")
    return None


def verify(
    step_dir: Path,
    *,
    share: tuple[int, int] | None = None,
    retries: int = RETRIES,
    wait_s: float = RETRY_WAIT_S,
) -> Problem | None:
    """Re-read the files of the manifests and compare; the first problem found. `share` = (i, n): only the
    manifests m with m % n == i (n processes split the work). A possibly transient read error is retried
    before it counts against the checkpoint."""
    manifests, problems = read(step_dir)
    if problems:
        return problems[0]
    for p in sorted(manifests):
        if share is not None and p % share[1] != share[0]:
            continue
        for rel, want in manifests[p]["files"].items():
            try:
                problem = retrying(
                    lambda rel=rel, want=want: _check(step_dir, rel, want),
                    retries=retries,
                    wait_s=wait_s,
                )
            except OSError as e:
                problem = Problem(rel, f"unreadable after {retries} retries: {e}")
            if problem:
                return problem
    return None
