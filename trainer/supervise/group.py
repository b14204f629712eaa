"""What every attempt's group of worker processes is: a subprocess.Popen look-alike for the supervisor
(pid, stdout, wait, poll, send_signal), its processes' output as one labelled stream, and the spawn that ties a
child's life to the supervisor's. The kinds of group: trainer.supervise.launcher; which exit codes the workers
chose: trainer.supervise.exit_codes.POLICY. Never imports jax.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child: the kernel sends SIGKILL when the supervisor dies, even by SIGKILL."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _child_setup(cpus: tuple[int, ...]) -> None:
    die_with_parent()
    if cpus:  # before exec: every thread the worker starts (XLA's pools too) inherits it
        os.sched_setaffinity(0, cpus)


def spawn(argv: list[str], env: Mapping[str, str], cpus: tuple[int, ...] = (), stdin=None) -> subprocess.Popen:
    """A worker process tied to the supervisor's life; `cpus`: the only CPUs it may run on (none: any)."""
    return subprocess.Popen(
        argv,
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=dict(env),
        preexec_fn=functools.partial(_child_setup, tuple(cpus)),
        start_new_session=True,
    )


class Merged:
    """The outputs of several processes as one stream of lines, labelled like `srun --label`."""

    def __init__(self, streams: list, *, label: bool, on_line=None):
        self._lines: list[bytes] = []
        self._cond = threading.Condition()
        self._open = len(streams)
        self._on_line = on_line
        for i, s in enumerate(streams):
            threading.Thread(target=self._read, args=(s, f"{i}: ".encode() if label else b""), daemon=True).start()

    def _read(self, stream, prefix: bytes) -> None:
        for raw in iter(stream.readline, b""):
            if self._on_line:
                self._on_line(raw.decode(errors="replace"))
            with self._cond:
                self._lines.append(prefix + raw)
                self._cond.notify()
        with self._cond:
            self._open -= 1
            self._cond.notify()

    def readline(self) -> bytes:
        """Next line of any process; b"" once every stream has ended."""
        with self._cond:
            self._cond.wait_for(lambda: self._lines or not self._open)
            return self._lines.pop(0) if self._lines else b""


class Group:
    """The processes of one attempt, behaving like one Popen."""

    processes: int
    nodes: list[str]
    launch_id: str
    pid: int
    stdout: Merged
    returncode: int | None = None
    # Wall-clock times, for the downtime's parts (trainer.observe.downtime): the first exit or failure report of
    # any process, and the first that was no survivor's reaction to a lost peer (0: none seen).
    noticed_t: float = 0.0
    cause_t: float = 0.0

    def _seen(self, cause: bool) -> None:
        now = time.time()
        self.noticed_t = self.noticed_t or now
        if cause:
            self.cause_t = self.cause_t or now

    def poll(self) -> int | None:
        raise NotImplementedError

    def send_signal(self, sig: int) -> None:
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired("worker group", timeout)
            time.sleep(0.01)  # a failure noticed within 10 ms: a poll of each process, nothing more
        return code

    def describe(self) -> dict:
        return {"processes": self.processes, **({"nodes": self.nodes} if self.nodes else {})}

    def blame_node(self, node: str, why: str) -> None:
        """The supervisor found what `node` did wrong (its process froze, its replica diverged): the one to
        blame for this attempt's end, whatever srun reports about the kill that followed."""

    def describe_exit(self) -> dict:
        """For the worker_exit event: which process or node failed first."""
        return {}

    def worker_pids(self) -> list[int]:
        """Worker pids on this machine, where known."""
        return []
