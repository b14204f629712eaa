"""The next attempt's worker processes, started before anything fails (launch.standby, local mode): each has its
interpreter up and the trainer imported (jax, flax, optax, orbax, grain: most of a cold start-up), then
waits on its stdin. A restart hands each one its attempt's environment in one line and it goes on as a freshly
launched worker would: jax.distributed, data, restore, compile. Nothing attempt-specific happens before the
line: no backend is initialised (on a GPU that would take the device's memory from the running worker), no
checkpoint read; its one write is a file saying it is ready (heartbeat/standby-<pid>.ready).

What it costs while nothing fails: one idle process per worker holding the imported modules (host memory,
no GPU memory), and the CPU time of its imports, taken once the running group has trained
attempt.STANDBY_AFTER_S, not beside its start (docs/multihost.md has the numbers). Never imports jax here:
the supervisor uses the first half, the worker the second.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from trainer.store import env_vars, rundir
from trainer.supervise.group import spawn


def ready_file(run_dir: Path, pid: int) -> Path:
    """Written by a standby process once its imports are done and it waits."""
    return Path(run_dir) / rundir.HEARTBEAT / f"standby-{pid}.ready"


class Standby:
    """`processes` workers started ahead with `env` (the next attempt's, but for what go() hands over)."""

    def __init__(
        self, argv: list[str], env: Mapping[str, str], *, processes: int, cpus: list[tuple[int, ...]], run_dir: Path
    ):
        self.run_dir = Path(run_dir)
        env = dict(env, **{env_vars.STANDBY: "1"})
        self.procs = [spawn(argv, env, cpus=cpus[i], stdin=subprocess.PIPE) for i in range(processes)]

    def ready_for(self, processes: int) -> bool:
        """Whether these processes can be the next attempt: as many, all still there (waiting, or still
        importing: handed over now, they go on as soon as their imports are done)."""
        return processes == len(self.procs) and all(p.poll() is None for p in self.procs)

    def ready(self) -> bool:
        """Every process has its imports done and waits."""
        return all(ready_file(self.run_dir, p.pid).exists() for p in self.procs)

    def go(self, envs: list[Mapping[str, str]]) -> list[subprocess.Popen]:
        """Hand each process its attempt's whole environment; they are the attempt's processes from now on.
        [] when one of them is gone (it died since ready_for): the caller starts the attempt cold."""
        try:
            for p, env in zip(self.procs, envs, strict=True):
                p.stdin.write(json.dumps(dict(env)).encode() + b"\n")
                p.stdin.close()  # nothing more comes: a worker never reads its stdin again
        except OSError:  # a broken pipe: that process died
            return []
        return self.procs

    def close(self) -> None:
        """Not needed after all (the next attempt differs, the run ends): let them go."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            ready_file(self.run_dir, p.pid).unlink(missing_ok=True)


def wait_for_go(run_dir: Path) -> None:
    """In a standby worker, after its imports: say so, and block until the supervisor hands over the attempt's
    environment; take it. No line (the supervisor ended, or let it go): leave quietly."""
    ready = ready_file(run_dir, os.getpid())
    try:
        ready.parent.mkdir(parents=True, exist_ok=True)
        ready.touch()
    except OSError:  # a full disk: it waits all the same, unannounced
        pass
    line = sys.stdin.buffer.readline()
    ready.unlink(missing_ok=True)
    if not line:
        os._exit(0)
    env = json.loads(line)
    os.environ.clear()
    os.environ.update(env)
