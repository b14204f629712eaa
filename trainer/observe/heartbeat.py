"""Worker heartbeats: a tiny JSON file per process with step, phase, time and node, replaced atomically;
and a pulse: another file per process that a thread of the worker rewrites every PULSE_S whatever the
training does.

The worker writes them; the supervisor (which never imports jax) reads them, as Beat and Pulse records, to
tell a slow phase from a hang (each trainer.config.Phase has its own timeout), and `status` to show the last
beat and whether it is overdue. When the group hangs, the pulses say
which process froze (SIGSTOP, a node gone silent): its pulse stops, while its peers, blocked in a collective
waiting for it, still pulse. A run-dir record, so it lives in observe.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from trainer.config import Phase
from trainer.observe.events import NO_SPACE
from trainer.store import env_vars, rundir
from trainer.store.rundir import read_json, write_json

PULSE_S = 1.0  # how often each worker says it is alive
# A pulse this old while a peer's is fresh: the process is frozen or gone (its node lost, powered off, hung in
# the kernel), not waiting; the supervisor acts on it at once, whatever supervisor.step_timeout_s says. Writes
# to a busy shared disk may lag: benchmarks/downtime.py measures the largest gap of live pulses (the margin).
PULSE_STALE_S = 6.0
PULSE_FRESH_S = 3.0  # a peer whose pulse is at most this old is alive: a frozen process is judged against it


def node_name(process: int) -> str:
    """The node a process runs on: SLURM's name for it, else the host name. TRAINER_NODE_NAME overrides both
    (tests on one machine pretend that each process is a node: "{process}" in it becomes the process index)."""
    forced = os.environ.get(env_vars.NODE_NAME, "")
    if forced:
        return forced.replace("{process}", str(process))
    return os.environ.get(env_vars.SLURMD_NODENAME) or socket.gethostname()


def heartbeat_path(run_dir: Path, process: int) -> Path:
    return Path(run_dir) / rundir.HEARTBEAT / f"worker-{process}.json"


def pulse_path(run_dir: Path, process: int) -> Path:
    return Path(run_dir) / rundir.HEARTBEAT / f"pulse-{process}.json"


@dataclass(frozen=True)
class Beat:
    """A process's heartbeat: the phase it entered, at which step and when; who wrote it (pid, the attempt's
    `launch`, its node), the fingerprint of the data it reads, and its clean-step timing marks."""

    phase: Phase
    step: int
    time: float
    pid: int | None = None
    launch: str | None = None  # the attempt (set by the supervisor): a stale file of an old attempt never counts
    data: str = ""
    node: str = ""
    timing: list[dict] | None = None  # trainer.train.step_log's marks, read by the straggler watch

    def to_json(self) -> dict:
        """The file's object, keys in this order; "timing" only when the worker measures it."""
        out = {"phase": str(self.phase), "step": self.step, "time": self.time, "pid": self.pid}
        out.update(launch=self.launch, data=self.data, node=self.node)
        return out if self.timing is None else dict(out, timing=self.timing)

    @classmethod
    def from_json(cls, obj: dict | None) -> Beat | None:
        """None when missing, torn or damaged (no phase we know, a step or time that is not a number): a reader
        treats it as not written yet."""
        if obj is None or not all(_number(obj.get(k)) for k in ("step", "time")):
            return None
        try:
            phase = Phase(obj.get("phase"))
        except ValueError:
            return None
        who = obj.get("pid"), obj.get("launch"), obj.get("data", ""), obj.get("node", "")
        return cls(phase, obj["step"], obj["time"], *who, obj.get("timing"))


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class Pulse:
    """A process's sign of life: when its pulse thread last wrote, who it is, and whether it leaves on purpose."""

    time: float
    pid: int | None = None
    launch: str | None = None
    node: str = ""
    ending: bool = False  # it leaves on purpose (done, preempted, ...): its pulse stopping is no failure

    def to_json(self) -> dict:
        """The file's object, keys in this order; "ending" only once it is true."""
        out = {"time": self.time, "pid": self.pid, "launch": self.launch, "node": self.node}
        return dict(out, ending=True) if self.ending else out

    @classmethod
    def from_json(cls, obj: dict | None, launch: str) -> Pulse | None:
        """None unless it is a pulse of attempt `launch` with a time (none yet, torn, or an older attempt's)."""
        if obj is None or obj.get("launch") != launch or not isinstance(obj.get("time"), (int, float)):
            return None
        return cls(obj["time"], obj.get("pid"), launch, obj.get("node", ""), bool(obj.get("ending")))


class Heartbeat:
    def __init__(self, run_dir: Path, process: int, *, data: str = ""):
        self.path = heartbeat_path(run_dir, process)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.data = data  # the fingerprint of the data this process reads: every process's is on record
        self.node = node_name(process)
        self.timing: list[dict] | None = None  # clean-step timing marks (trainer.train.step_log): the straggler watch
        self._pulse = pulse_path(run_dir, process)
        self._ending = False
        self._lock = threading.Lock()
        threading.Thread(target=self._pulse_forever, name="pulse", daemon=True).start()

    def _pulse_once(self) -> None:
        launch = os.environ.get(env_vars.LAUNCH_ID, "")
        try:
            with self._lock:
                pulse = Pulse(time.time(), os.getpid(), launch, self.node, self._ending)
                write_json(self._pulse, pulse.to_json(), indent=None)
        except OSError as e:
            if e.errno not in NO_SPACE:
                raise

    def _pulse_forever(self) -> None:
        while True:
            self._pulse_once()
            time.sleep(PULSE_S)

    def ending(self) -> None:
        """This process leaves on purpose (done, preempted, spike, ...): its pulse stopping soon after is no
        failure, whatever its peers still do."""
        self._ending = True
        self._pulse_once()

    def beat(self, phase: Phase, step: int) -> None:
        launch = os.environ.get(env_vars.LAUNCH_ID, "")
        beat = Beat(phase, step, time.time(), os.getpid(), launch, self.data, self.node, self.timing)
        try:
            write_json(self.path, beat.to_json(), indent=None)
        except OSError as e:  # a full disk: the last beat stays; a real hang is still caught by its age
            if e.errno not in NO_SPACE:
                raise


def read_pulse(run_dir: Path, process: int, launch: str) -> Pulse | None:
    """A process's pulse in this attempt (`launch`), or None (none yet, torn, or an older attempt's)."""
    return Pulse.from_json(read_json(pulse_path(run_dir, process)), launch)


def read(path: Path) -> Beat | None:
    """The heartbeat, or None when it is missing, torn or damaged: a reader treats it as not written yet."""
    return Beat.from_json(read_json(path))


@dataclass(frozen=True)
class Snapshot:
    """Every process's heartbeat as read at one moment: the supervisor reads them once per poll and hands the
    snapshot to everyone who judges them (the hang and frozen checks, the straggler watch, the step its events
    carry, the failure's moment)."""

    files: tuple[Beat | None, ...]  # as read (None: missing, torn or damaged), whichever attempt wrote them
    launch: str  # the attempt asked about
    pulses: tuple[Pulse | None, ...] = ()  # each process's pulse in this attempt (read_pulse; None: none yet)

    @property
    def beats(self) -> list[Beat | None]:
        """This attempt's heartbeats (None until the process writes one)."""
        return [hb if hb and hb.launch == self.launch else None for hb in self.files]

    @property
    def ready(self) -> bool:
        """Process 0 beat in this attempt: a worker writes heartbeats only after validating the config."""
        return self.beats[0] is not None

    @property
    def step(self) -> int | None:
        """Process 0's latest step, whichever attempt wrote it: one that fails before its first beat failed at
        the step the one before it reached."""
        return self.files[0].step if self.files[0] else None


def snapshot(run_dir: Path, processes: int, launch: str) -> Snapshot:
    return Snapshot(
        tuple(read(heartbeat_path(run_dir, i)) for i in range(processes)),
        launch,
        tuple(read_pulse(run_dir, i, launch) for i in range(processes)),
    )


def after_last_pulse(pulse: Pulse) -> float:
    """When a process that stopped pulsing stopped: within PULSE_S after its last pulse; the midpoint (+-0.5 s)."""
    return pulse.time + PULSE_S / 2
