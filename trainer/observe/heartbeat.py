"""Worker heartbeats: a tiny JSON file per process with step, phase, time and node, replaced atomically;
and a pulse: another file per process that a thread of the worker rewrites every PULSE_S whatever the
training does.

The worker writes them; the supervisor (which never imports jax) reads them to tell a slow phase from a
hang, and `status` to show the last beat and whether it is overdue. When the group hangs, the pulses say
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

from trainer.config import PHASES, SupervisorConfig
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


def phase_timeout(sc: SupervisorConfig, phase: str) -> float:
    """How long a worker may stay silent in `phase` before it counts as hung."""
    return {
        "startup": sc.startup_timeout_s,
        "compile": sc.startup_timeout_s,
        "restore": sc.restore_timeout_s,
        "checkpoint": sc.checkpoint_timeout_s,
        "eval": sc.eval_timeout_s,
        "done": sc.checkpoint_timeout_s,
    }.get(phase, sc.step_timeout_s)


def heartbeat_path(run_dir: Path, process: int) -> Path:
    return Path(run_dir) / rundir.HEARTBEAT / f"worker-{process}.json"


def pulse_path(run_dir: Path, process: int) -> Path:
    return Path(run_dir) / rundir.HEARTBEAT / f"pulse-{process}.json"


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
        record = {"time": time.time(), "pid": os.getpid(), "launch": launch, "node": self.node}
        try:
            with self._lock:
                write_json(self._pulse, dict(record, **({"ending": True} if self._ending else {})), indent=None)
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

    def beat(self, phase: str, step: int) -> None:
        # "launch" names the attempt (set by the supervisor), so a stale file from an old attempt never counts.
        try:
            write_json(
                self.path,
                {
                    "phase": phase,
                    "step": step,
                    "time": time.time(),
                    "pid": os.getpid(),
                    "launch": os.environ.get(env_vars.LAUNCH_ID, ""),
                    "data": self.data,
                    "node": self.node,
                    **({"timing": self.timing} if self.timing is not None else {}),
                },
                indent=None,
            )
        except OSError as e:  # a full disk: the last beat stays; a real hang is still caught by its age
            if e.errno not in NO_SPACE:
                raise


def read_pulse(run_dir: Path, process: int, launch: str) -> dict | None:
    """A process's pulse in this attempt (`launch`), or None (none yet, torn, or an older attempt's)."""
    p = read_json(pulse_path(run_dir, process))
    ok = p is not None and p.get("launch") == launch and isinstance(p.get("time"), (int, float))
    return p if ok else None


def read(path: Path) -> dict | None:
    """The heartbeat, or None when it is missing, torn or damaged: a reader treats it as not written yet."""
    hb = read_json(path)
    if (
        hb is None
        or hb.get("phase") not in PHASES
        or not all(isinstance(hb.get(k), (int, float)) and not isinstance(hb.get(k), bool) for k in ("step", "time"))
    ):
        return None
    return hb


@dataclass(frozen=True)
class Snapshot:
    """Every process's heartbeat as read at one moment: the supervisor reads them once per poll and hands the
    snapshot to everyone who judges them (the hang and frozen checks, the straggler watch, the step its events
    carry, the failure's moment)."""

    files: tuple[dict | None, ...]  # as read (None: missing, torn or damaged), whichever attempt wrote them
    launch: str  # the attempt asked about
    pulses: tuple[dict | None, ...] = ()  # each process's pulse in this attempt (read_pulse; None: none yet)

    @property
    def beats(self) -> list[dict | None]:
        """This attempt's heartbeats (None until the process writes one)."""
        return [hb if hb and hb.get("launch") == self.launch else None for hb in self.files]

    @property
    def ready(self) -> bool:
        """Process 0 beat in this attempt: a worker writes heartbeats only after validating the config."""
        return self.beats[0] is not None

    @property
    def step(self) -> int | None:
        """Process 0's latest step, whichever attempt wrote it: one that fails before its first beat failed at
        the step the one before it reached."""
        return self.files[0]["step"] if self.files[0] else None


def snapshot(run_dir: Path, processes: int, launch: str) -> Snapshot:
    return Snapshot(
        tuple(read(heartbeat_path(run_dir, i)) for i in range(processes)),
        launch,
        tuple(read_pulse(run_dir, i, launch) for i in range(processes)),
    )


def after_last_pulse(pulse: dict) -> float:
    """When a process that stopped pulsing stopped: within PULSE_S after its last pulse; the midpoint (+-0.5 s)."""
    return pulse["time"] + PULSE_S / 2
