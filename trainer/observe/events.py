"""events.jsonl: the run's one event log (worker and supervisor append to the same file), and its readers.

One JSON object per line with `event`, `time` and usually `step`, strict JSON (a NaN or infinite loss is
null). Process 0 of a worker group writes the run's events; every process writes its own host's health and
hardware alerts, tagged with its "process" and "node"; the supervisor tags its own records with "by":
"supervisor".
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from trainer.store.event_names import WORKER_START
from trainer.store.rundir import dumps

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class EventLog:
    """Appends events, one flushed line each. `hold=True` keeps them in memory until `open()`: the
    supervisor holds its first events back until a worker has accepted the config, so that a bad config
    never writes into an existing run dir. A disabled log (processes other than 0) writes nothing.
    A full disk drops events (one warning on stderr) instead of killing a run whose checkpoints still fit."""

    def __init__(
        self, path: Path, *, enabled: bool = True, by: str | None = None, hold: bool = False, tags: dict | None = None
    ):
        """`tags`: fields every record carries (a host's health log: its process and node)."""
        self._path, self._enabled, self._by, self._tags = Path(path), enabled, by, tags or {}
        self._held: list[dict] = []
        self._fh = None
        self._dropped = 0
        if enabled and not hold:
            self.open()

    def write(self, event: str, step: int | None = None, **fields) -> None:
        if not self._enabled:
            return
        rec = {"event": event, "time": time.time()}
        if step is not None:
            rec["step"] = step
        if self._by:
            rec["by"] = self._by
        rec.update(self._tags)
        rec.update(fields)
        if self._fh is None:
            self._held.append(rec)
        else:
            self._append(dumps(rec) + "\n")

    def _append(self, line: str) -> None:
        data, fd = line.encode(), self._fh.fileno()
        try:
            # One unbuffered O_APPEND write per event: a failure leaves nothing queued to land half-way later,
            # and a short write (the disk filled mid-line) is cut off again so the next event starts a line.
            if (n := os.write(fd, data)) < len(data):
                os.ftruncate(fd, os.lseek(fd, 0, os.SEEK_END) - n)
                raise OSError(errno.ENOSPC, "short write")
        except OSError as e:
            if e.errno not in NO_SPACE:
                raise
            if not self._dropped:
                print(
                    f"warning: {self._path}: no space left on the device; events are dropped until there is "
                    f"(training and checkpoints carry on)",
                    file=sys.stderr,
                    flush=True,
                )
            self._dropped += 1

    def open(self) -> None:
        if self._fh is None and self._enabled:
            self._fh = open(self._path, "ab", buffering=0)
            for rec in self._held:
                self._append(dumps(rec) + "\n")
            self._held = []

    def close(self) -> None:
        if self._fh:
            self._fh.close()
            self._fh = None


def iter_events(path: Path, skipped: list[str] | None = None) -> Iterator[dict]:
    """events.jsonl oldest first, streamed (a long run logs millions of steps); unreadable lines (one torn
    by a kill mid-write) are left out, and appended to `skipped` when given."""
    if not Path(path).is_file():
        return
    with open(path, errors="replace") as fh:
        for line in fh:
            try:
                yield json.loads(line)
            except ValueError:
                if skipped is not None and line.strip():
                    skipped.append(line)


def read_events(path: Path) -> list[dict]:
    return list(iter_events(path))


def _lines_backwards(path: Path, block: int = 1 << 16) -> Iterator[bytes]:
    """Lines of a file from the last to the first, reading only as much as the caller consumes."""
    with open(path, "rb") as fh:
        pos = fh.seek(0, os.SEEK_END)
        rest = b""
        while pos > 0:
            n = min(block, pos)
            pos -= n
            fh.seek(pos)
            lines = (fh.read(n) + rest).split(b"\n")
            rest = lines[0]
            yield from (line for line in reversed(lines[1:]) if line)
        if rest:
            yield rest


def events_newest_first(path: Path) -> Iterator[dict]:
    """events.jsonl from the end: readers that need only the recent past never parse a long history."""
    if not Path(path).is_file():
        return
    for line in _lines_backwards(Path(path)):
        try:
            yield json.loads(line)
        except ValueError:  # a line torn by a kill mid-write
            continue


def from_last_worker(path: Path, event: str) -> dict | None:
    """The newest `event` record written by the worker that started last (None if it wrote none): what the
    supervisor reads about the attempt that just exited."""
    for e in events_newest_first(path):
        if e.get("event") == event:
            return e
        if e.get("event") == WORKER_START:
            return None
    return None


def newest_record(path: Path, event: str, step: int) -> dict | None:
    """The newest `event` record logged at `step`, or None."""
    return next((e for e in events_newest_first(path) if e.get("event") == event and e.get("step") == step), None)
