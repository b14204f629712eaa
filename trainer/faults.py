"""Built-in fault injection, driven by the config's `faults` list and off by default.

Each fault fires at most once per run: it is recorded in the run dir (fsynced) before it fires, so
the restart it causes does not trigger it again.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from trainer.config import Fault

KINDS = ("crash", "hang", "crash_mid_save", "slow", "signal")
CRASH_EXIT = 13


class FaultInjector:
    def __init__(self, faults: list[Fault], run_dir: Path, *, enabled: bool = True):
        self._faults = list(enumerate(faults)) if enabled else []
        self._path = Path(run_dir) / "faults_fired.json"
        self._fired = set(json.loads(self._path.read_text())) if self._path.is_file() else set()

    def _pending(self, kind: str, step: int, *, open_ended: bool = False) -> Fault | None:
        for i, f in self._faults:
            end = float("inf") if open_ended else f.step + max(f.count, 1)
            if f.kind == kind and i not in self._fired and f.step <= step < end:
                return f
        return None

    def _record(self, fault: Fault) -> None:
        self._fired.add(next(i for i, f in self._faults if f is fault))
        with open(self._path, "w") as fh:
            json.dump(sorted(self._fired), fh)
            fh.flush()
            os.fsync(fh.fileno())

    def before_step(self, step: int) -> None:
        """Called with the step about to run."""
        if f := self._pending("slow", step):
            if step == f.step + max(f.count, 1) - 1:
                self._record(f)
            time.sleep(f.seconds)
        if f := self._pending("crash", step):
            self._record(f)
            os._exit(CRASH_EXIT)
        if f := self._pending("signal", step):
            self._record(f)
            os.kill(os.getpid(), getattr(signal, f.signal))
        if f := self._pending("hang", step):
            self._record(f)
            while True:  # a hung collective looks like this from the outside: alive, no progress
                time.sleep(3600)

    def after_save_started(self, step: int) -> None:
        """Called right after an async save was started for `step`: die while it is being written."""
        if f := self._pending("crash_mid_save", step, open_ended=True):
            self._record(f)
            os._exit(CRASH_EXIT)
