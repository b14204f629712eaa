"""The `node` fault: the firing process's whole node is lost at once, as when a host crashes or loses its
power or its NIC. Every process of this job on the node (its tasks; on the batch host the batch script,
the supervisor and srun too), the slurmstepds that run them and the node's slurmd are stopped together,
then killed, and this run's node-local checkpoint storage goes with them. SLURM then sees a node that no
longer answers and marks it down after SlurmdTimeout, as on a real cluster.

Stopping slurmd needs the right to signal it (root, as in the test cluster of tests/slurm_cluster.py);
without it the node's slurmd stays up and SLURM sees tasks that died, not a node lost. Outside SLURM the
node is this process alone: its node-local storage is deleted and it is SIGKILLed.

Several slurmd may run on one machine (one per emulated node, as in the test cluster; other clusters'
too): the node's own is the one started for this node name (`slurmd -N NAME`, or the only one), with this
job's SLURM_CONF and, if still ambiguous, in this process's mount namespace.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import NoReturn

from trainer.store import env_vars


def now(node_local: Path | None) -> NoReturn:
    """Lose this process's node: delete `node_local`, then stop and kill the node's processes and this one."""
    victims = node_processes() - {os.getpid()}
    print(f"injected fault: node lost ({len(victims)} processes killed with it)", file=sys.stderr, flush=True)
    if node_local is not None:
        shutil.rmtree(node_local, ignore_errors=True)
    for sig in (signal.SIGSTOP, signal.SIGKILL):  # stopped first: none of them reacts to another's death
        for pid in victims:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable")


def node_processes() -> set[int]:
    """This job's processes on this node, their slurmstepds and the node's slurmd ({} outside SLURM)."""
    job, node = os.environ.get(env_vars.SLURM_JOB_ID), os.environ.get(env_vars.SLURMD_NODENAME)
    if not job or not node:
        return set()
    tasks = set()
    for pid in _pids():
        env = _environ(pid)
        if env.get(env_vars.SLURM_JOB_ID) == job and env.get(env_vars.SLURMD_NODENAME) == node:
            tasks.add(pid)
    stepds = {ppid for pid in tasks if _comm(ppid := _ppid(pid)) == "slurmstepd"}
    return tasks | stepds | _slurmd(node)


def _slurmd(node: str) -> set[int]:
    daemons = [pid for pid in _pids() if _comm(pid) == "slurmd"]
    named = [pid for pid in daemons if _node_arg(pid) == node]
    if not named:
        named = [pid for pid in daemons if _node_arg(pid) is None]
    conf = os.environ.get(env_vars.SLURM_CONF)
    if len(named) > 1:
        named = [pid for pid in named if _environ(pid).get(env_vars.SLURM_CONF) == conf]
    if len(named) > 1:
        named = [pid for pid in named if _mnt_ns(pid) == _mnt_ns(os.getpid())]
    return set(named)


def _node_arg(pid: int) -> str | None:
    """The node name slurmd was started for (`-N NAME` / `-NNAME`), or None."""
    args = _cmdline(pid)
    for i, a in enumerate(args):
        if a == "-N" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("-N") and len(a) > 2:
            return a[2:]
    return None


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _read(pid: int, name: str) -> bytes:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read()
    except OSError:  # gone, or not ours to read
        return b""


def _environ(pid: int) -> dict[str, str]:
    pairs = (item.split(b"=", 1) for item in _read(pid, "environ").split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _cmdline(pid: int) -> list[str]:
    return [a.decode(errors="replace") for a in _read(pid, "cmdline").split(b"\0") if a]


def _comm(pid: int) -> str:
    return _read(pid, "comm").decode(errors="replace").strip()


def _ppid(pid: int) -> int:
    stat = _read(pid, "stat").decode(errors="replace")
    fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
    return int(fields[1]) if len(fields) > 1 else 0


def _mnt_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None
