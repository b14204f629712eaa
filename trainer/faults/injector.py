"""Built-in fault injection, driven by the config's `faults` list and off by default.

Each fault fires at most once per run: it is recorded in the run dir (fsynced) before it fires, so
the restart it causes does not trigger it again. A fault fires on one process (`process`, 0 unless set);
nan, spike and bitflip change the train state, so every process applies them and their process records
them. The kinds and phases a config may name are declared with the config's faults section
(trainer.config.supervision: FAULT_KINDS, FAULT_PHASES).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import statistics
import threading
import time
from pathlib import Path
from typing import Protocol

from trainer.config import Fault, Phase
from trainer.faults import corrupt, lose_node
from trainer.store import rundir
from trainer.store.rundir import write_json


class InjectedStartupError(RuntimeError):
    """The `startup` fault: an exception while a worker starts, as a corrupt input or a race would raise."""


CRASH_EXIT = 13


class Storage(Protocol):
    """What the disk_full fault fills: the worker's checkpoint tiers (trainer.ckpt.tiers.Tiers)."""

    def fail_next_save(self, error: OSError) -> None: ...


class FaultInjector:
    def __init__(
        self, faults: list[Fault], run_dir: Path, *, process: int = 0, node: str = "", node_local: Path | None = None
    ):
        """`process`: this process's index; `node`: the node it runs on (a fault with a `node` fires on
        whichever process runs there); `node_local`: what the `node` fault deletes with its node (this run's
        part of the node-local tier)."""
        self._all = list(enumerate(faults))
        self._faults = [(i, f) for i, f in self._all if (f.node == node if f.node else f.process == process)]
        self.process, self.node_local = process, node_local
        self._path, self._log = Path(run_dir) / rundir.FAULTS_FIRED, Path(run_dir) / rundir.FAULT_LOG
        self._run_dir = Path(run_dir)
        self._logged: set[int] = set()  # id(fault): its firing is in the fault log
        self._fired = self._read()
        self._ecc_from: dict[int, tuple[int, int]] = {}  # id(fault) -> (first step, errors per step)
        self._hog: _Hog | None = None  # the hog fault's thread, while it runs
        self._step_t: list[float] = []  # when the latest steps began (a slow fault's step_multiple reads them)
        self._slow_s: dict[int, float] = {}  # id(fault) -> its sleep, fixed when it first fires
        self._times_steps = any(f.step_multiple for _, f in self._faults)

    def _pending(self, kind: str, step: int, *, open_ended: bool = False, phase: Phase = Phase.STEP) -> Fault | None:
        for i, f in self._faults:
            end = float("inf") if open_ended else f.step + max(f.count, 1)
            if f.kind == kind and f.phase == phase and i not in self._fired and f.step <= step < end:
                return f
        return None

    def _read(self) -> set[int]:
        return set(json.loads(self._path.read_text())) if self._path.is_file() else set()

    def _record(self, fault: Fault, step: int | None, *, log: bool = True, **detail) -> None:
        """`fault` has fired (at `step`): never again in this run. `log`: also write when (a fault that lasts
        several steps is logged at its first and recorded at its last)."""
        if fault.repeat or fault.node:  # a node's fault is the node's: it fires on every attempt that runs there
            return
        self._fired.add(next(i for i, f in self._all if f is fault))
        if fault.process != self.process:
            return
        # Other processes record theirs in the same file: keep what they wrote since this one read it.
        self._fired |= self._read()
        write_json(self._path, sorted(self._fired), durable=True, indent=None)
        if log:
            self._log_fired(fault, step, **detail)

    def _log_fired(self, fault: Fault, step: int | None, **detail) -> None:
        """When a fault fired, for the fire drill's time to detect: durable before the fault takes the process."""
        if fault.repeat or fault.node or fault.process != self.process or id(fault) in self._logged:
            return
        self._logged.add(id(fault))
        index = next(i for i, f in self._all if f is fault)
        line = dict(index=index, kind=fault.kind, step=step, phase=fault.phase, process=self.process, **detail)
        with open(self._log, "a") as fh:
            fh.write(json.dumps(dict(line, time=time.time())) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def at_startup(self) -> None:
        """Called once while the worker starts, before its first heartbeat: the `startup` fault raises."""
        for i, f in self._faults:
            if f.kind == "startup" and i not in self._fired:
                self._record(f, None)
                raise InjectedStartupError(f"injected fault: start-up failure (faults[{i}])")

    def before_step(self, step: int) -> None:
        """Called with the step about to run."""
        if (f := self._pending("ecc", step, open_ended=True)) and id(f) not in self._ecc_from:
            self._record(f, step)
            self._ecc_from[id(f)] = (step, max(f.count, 1))
        if self._times_steps:
            self._step_t = [*self._step_t[-5:], time.perf_counter()]
        if f := self._pending("slow", step):
            self._log_fired(f, step)
            if step == f.step + max(f.count, 1) - 1:
                self._record(f, f.step, log=False)
            time.sleep(self._slow_seconds(f))
        self._hog_at(step)
        if f := self._pending("crash", step):
            self._record(f, step)
            os._exit(CRASH_EXIT)
        if f := self._pending("corrupt", step):
            local = self.node_local / f"process_{self.process}" if self.node_local else None
            self._record(f, step, hit=corrupt.newest(self._run_dir, f.how, local))
            os._exit(CRASH_EXIT)
        if f := self._pending("signal", step):
            self._record(f, step)
            os.kill(os.getpid(), getattr(signal, f.signal))
        if f := self._pending("node", step):
            self._record(f, step)
            lose_node.now(self.node_local)
        self._hang_or_slow(Phase.STEP, step)

    def _slow_seconds(self, f: Fault) -> float:
        """A slow fault's sleep: `seconds`, or `step_multiple` times the median of the steps just before it
        first fired (the same slowdown on a fast or a slow machine)."""
        if not f.step_multiple:
            return f.seconds
        if id(f) not in self._slow_s:
            gaps = [b - a for a, b in zip(self._step_t, self._step_t[1:])]
            self._slow_s[id(f)] = f.step_multiple * statistics.median(gaps) if gaps else f.seconds
        return self._slow_s[id(f)]

    def _hog_at(self, step: int) -> None:
        """The hog fault: from its step, for `count` steps, a thread of this process burns CPU in Python,
        holding the GIL but at the interpreter's switch points: the training thread's host work (data,
        dispatch, bookkeeping) slows, as with a noisy neighbour or a runaway callback, without a sleep in the
        step. `seconds` > 0: a burst of that many seconds at each step; 0: all the time."""
        f = self._pending("hog", step)
        if f is not None and self._hog is None:
            self._log_fired(f, step)
            self._hog = _Hog(f.seconds)
            print(f"worker: fault hog from step {step} for {max(f.count, 1)} steps", flush=True)
        if f is not None:
            self._hog.go.set()
            if step == f.step + max(f.count, 1) - 1:
                self._record(f, f.step, log=False)
        elif self._hog is not None:
            self._hog.stop = True
            self._hog.go.set()
            self._hog = None

    def in_phase(self, phase: Phase, step: int) -> None:
        """Called right after the worker's heartbeat says it entered `phase` (startup, restore, compile,
        checkpoint): the hang and slow faults of that phase fire here."""
        self._hang_or_slow(phase, step)

    def _hang_or_slow(self, phase: Phase, step: int) -> None:
        # Outside the step phase a fault fires once, the first time the phase is entered at or after its step.
        other = phase != Phase.STEP
        if other and (f := self._pending("slow", step, open_ended=True, phase=phase)):
            self._record(f, step)
            time.sleep(f.seconds)
        if f := self._pending("hang", step, open_ended=other, phase=phase):
            self._record(f, step)
            while True:  # a hung collective looks like this from the outside: alive, no progress
                time.sleep(3600)

    def ecc_errors(self, step: int) -> int:
        """Simulated ECC count at `step`, rising from the ecc fault's step on (read by the health collector
        thread: a plain read of what before_step set)."""
        return sum((step - first + 1) * rate for first, rate in list(self._ecc_from.values()) if step >= first)

    def lr_scale(self, step: int, base: float) -> float:
        """The LR scale for the update about to run at `step`: nan poisons it (the params become NaN, like a
        numerical blow-up), spike multiplies it by the fault's scale (a too-hot LR for one update)."""
        for i, f in self._all:
            if f.kind in ("nan", "spike") and f.step == step and i not in self._fired:
                self._record(f, step)
                return float("nan") if f.kind == "nan" else base * f.scale
        return base

    def disk_full(self, step: int, storage: Storage) -> None:
        """Called before the durable save of `step`: the first at or after the disk_full fault's step finds the
        disk full (`storage` fails that save with ENOSPC, as the file system would)."""
        if f := self._pending("disk_full", step, open_ended=True):
            self._record(f, step)
            storage.fail_next_save(OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected: disk_full fault)"))

    def bitflip(self, step: int) -> bool:
        """Whether to flip one bit in one replica's params before the update at `step` (silent data corruption:
        trainer.train.replicas does it). Every process asks; the one holding that replica flips."""
        for i, f in self._all:
            if f.kind == "bitflip" and f.step == step and i not in self._fired:
                self._record(f, step)
                return True
        return False

    def slow_saves(self) -> bool:
        return any(f.kind == "slow_save" for _, f in self._faults)

    def commit_delay(self, step: int) -> float:
        """The slow_save fault: seconds the storage takes on top to commit the durable save of `step` (read
        in the thread that commits it: Orbax's background thread, or the caller's when saves are synchronous)."""
        if f := self._pending("slow_save", step, open_ended=True):
            self._record(f, step)
            return f.seconds
        return 0.0

    def after_save_started(self, step: int) -> None:
        """Called right after an async save was started for `step`: die while it is being written."""
        if f := self._pending("crash_mid_save", step, open_ended=True):
            self._record(f, step)
            os._exit(CRASH_EXIT)


class _Hog:
    def __init__(self, burst_s: float):
        self.burst_s, self.stop, self.go = burst_s, False, threading.Event()
        threading.Thread(target=self._run, name="hog", daemon=True).start()

    def _run(self) -> None:
        while not self.stop:
            self.go.wait()
            if self.burst_s:
                self.go.clear()
            end = time.perf_counter() + (self.burst_s or 0.05)
            while time.perf_counter() < end:
                sum(i * i for i in range(1000))
