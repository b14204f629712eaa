"""Starts one attempt's worker processes and tears them down together: N local subprocesses (tests,
laptops) or one `srun` step on a SLURM allocation (trainer.supervise.srun_group), where a failed node is swapped
for a spare.

A group looks like a subprocess.Popen to the supervisor (pid, stdout, wait, poll, send_signal), so the
supervisor's policy does not care how many processes there are. Never imports jax.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

from trainer.config import ConfigError, LaunchConfig
from trainer.store import env_vars, membership, rundir
from trainer.supervise import guard
from trainer.supervise.exit_codes import CONSEQUENCES, PEERS_FOLLOW
from trainer.supervise.group import Group, Merged, die_with_parent, spawn
from trainer.supervise.nodes import (
    down_nodes,
    hostnames,
    plan_nodes,
    read_suspects,
    srun_command,
    write_suspects,
)
from trainer.supervise.srun_group import SrunGroup
from trainer.supervise.standby import Standby


class LocalGroup(Group):
    """N worker processes on this machine; process 0 hosts the jax coordinator on a local port."""

    def __init__(
        self,
        argv: list[str],
        env: Mapping[str, str],
        *,
        processes: int,
        port: int,
        grace_s: float,
        cpus: int = 0,
        standby: Standby | None = None,
    ):
        """`cpus` > 0: process i runs on its own `cpus` CPUs of this machine (round robin), as on its own host.
        `standby`: processes started ahead for this attempt (trainer.supervise.standby), used if they fit."""
        self.processes, self.nodes, self.launch_id = processes, [], uuid.uuid4().hex[:12]
        self._grace_s = grace_s
        base = dict(env, **{env_vars.LAUNCH_ID: self.launch_id})
        if processes > 1:
            base.update({env_vars.NUM_PROCESSES: str(processes), env_vars.COORDINATOR: f"127.0.0.1:{port}"})
        envs = [dict(base, **({env_vars.PROCESS_ID: str(i)} if processes > 1 else {})) for i in range(processes)]
        self.standby = "" if standby is None else "ready" if standby.ready() else "starting"
        self.procs = standby.go(envs) if standby is not None and standby.ready_for(processes) else []
        if not self.procs:  # none, another count, or one of them gone (even while it was handed its attempt)
            if standby is not None:
                standby.close()
                self.standby = ""
            self.procs = [spawn(argv, e, cpus=pinned(i, cpus)) for i, e in enumerate(envs)]
        self.pid = self.procs[0].pid
        self.stdout = Merged([p.stdout for p in self.procs], label=processes > 1)
        self._exits: list[tuple[int, int]] = []  # (process, code) in the order we saw them
        self._killed: set[int] = set()  # processes we tore down: their codes are consequences, not causes
        self._first_exit_t = 0.0

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        seen = {i for i, _ in self._exits}
        for i, p in enumerate(self.procs):
            if i not in seen and p.poll() is not None:
                self._exits.append((i, p.returncode))
                self._first_exit_t = self._first_exit_t or time.monotonic()
                if p.returncode != 0 and i not in self._killed:
                    self._seen(cause=p.returncode not in CONSEQUENCES)
        causes = [c for i, c in self._exits if i not in self._killed]
        broken = [c for c in causes if c not in PEERS_FOLLOW]
        late = causes and time.monotonic() - self._first_exit_t > self._grace_s
        if (broken or late) and len(self._exits) < self.processes:
            # A peer is gone: the others would wait in their next collective forever. Kill them now.
            self._killed |= {i for i, p in enumerate(self.procs) if p.poll() is None}
            self.send_signal(signal.SIGKILL)
        if len(self._exits) < self.processes:
            return None
        self.returncode = (broken or [c for c in causes if c] or [0])[0]
        return self.returncode

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def describe(self) -> dict:
        """For the worker_start event; `standby`: its processes were started ahead, "ready" (imports done) or
        "starting" (they go on as soon as their imports are)."""
        return dict(super().describe(), **({"standby": self.standby} if self.standby else {}))

    def describe_exit(self) -> dict:
        if self.processes == 1:
            return {}
        return {"exits": [[i, c] for i, c in self._exits], "torn_down": sorted(self._killed)}

    def send_signal(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass


class Launcher:
    """Builds each attempt's group; in SLURM mode it also remembers suspect nodes across attempts, and across
    jobs through RUN_DIR/suspect_nodes.json (a requeued job's new supervisor still avoids them)."""

    def __init__(self, cfg: LaunchConfig, env: Mapping[str, str] = os.environ, run_dir: Path | None = None):
        self.cfg = cfg
        self.suspects: dict[str, dict] = {}  # node -> {"reason", "time", "job"}
        self.new_suspects: list[tuple[str, str]] = []  # (node, reason) found by the latest start(), for events
        self.retried: list[str] = []  # suspects the latest start() used again (launch.suspect_retry_minutes)
        self._last: Group | None = None
        self._standby: Standby | None = None  # the next attempt's processes, started ahead (warm)
        self._guard: subprocess.Popen | None = None  # the guards' srun step (start_guard)
        self._guarded = False
        self.allocated: list[str] = []
        self._file = Path(run_dir) / rundir.SUSPECT_NODES if run_dir is not None else None
        self._run_dir = Path(run_dir) if run_dir is not None else Path(".")
        if cfg.mode == "slurm":
            if env_vars.SLURM_JOB_ID not in env:
                raise ConfigError("launch.mode=slurm needs a SLURM allocation (run launch/slurm.sbatch with sbatch)")
            self.job = env[env_vars.SLURM_JOB_ID]
            self.allocated = hostnames(env[env_vars.SLURM_JOB_NODELIST])
            need = cfg.processes // cfg.processes_per_node
            if len(self.allocated) < need and not cfg.min_processes:
                raise ConfigError(
                    f"launch.processes={cfg.processes} at {cfg.processes_per_node} per node needs "
                    f"{need} nodes; the allocation has {len(self.allocated)}"
                )
            self.suspects = read_suspects(self._file) if self._file else {}

    def _suspect(self, node: str, reason: str) -> None:
        if node in self.suspects:  # the first reason stands; the node is avoided either way
            return
        self.suspects[node] = {"reason": reason, "time": time.time(), "job": self.job}
        self.new_suspects.append((node, reason))

    def start(self, attempt: int, argv: list[str], env: Mapping[str, str]) -> Group:
        env = dict(env, **{env_vars.ATTEMPT: str(attempt)})
        if self.cfg.mode == "local":
            port = self.cfg.coordinator_port + attempt if self.cfg.coordinator_port else free_port()
            standby, self._standby = self._standby, None
            self._last = LocalGroup(
                argv,
                env,
                processes=self.cfg.processes,
                port=port,
                grace_s=self.cfg.exit_grace_s,
                cpus=self.cfg.cpus_per_process,
                standby=standby,
            )
            return self._last
        self.new_suspects = []
        if isinstance(self._last, SrunGroup):
            for node, why in self._last.blame():
                self._suspect(node, why)
        down = down_nodes(self.allocated)
        for node, state in down.items():
            self._suspect(node, f"SLURM reports it {state}")
        nodes, n, avoid = self._plan(set(down))
        self.retried = [node for node in nodes if node in self.suspects and node not in avoid]
        for node in self.retried:  # its retry time came and SLURM says it is up: trusted again
            del self.suspects[node]
        if (self.new_suspects or self.retried) and self._file:
            write_suspects(self._file, self.suspects)
        launch_id = f"trainer-{uuid.uuid4().hex[:8]}"
        env.update(
            {env_vars.LAUNCH_ID: launch_id, env_vars.COORDINATOR_PORT: str(membership.slurm_port(self.cfg, env))}
        )
        cmd = srun_command(argv, nodes=nodes, processes=n, per_node=self.cfg.processes_per_node, launch_id=launch_id)
        self._last = SrunGroup(cmd, env, processes=n, nodes=nodes, launch_id=launch_id, job_id=self.job)
        return self._last

    def _plan(self, down: set[str], also: set[str] = frozenset()) -> tuple[list[str], int, set[str]]:
        """plan_nodes avoiding the suspects, but those launch.suspect_retry_minutes old that SLURM says are up,
        and `also`; and the set avoided (plan_nodes may still fall back on it: a lost process is not a lost
        node)."""
        retry_s, now = 60 * self.cfg.suspect_retry_minutes, time.time()
        avoid = {n for n, s in self.suspects.items() if not retry_s or now - s["time"] < retry_s or n in down}
        avoid |= also
        c = self.cfg
        return (
            *plan_nodes(
                self.allocated,
                avoid,
                processes=c.processes,
                per_node=c.processes_per_node,
                min_processes=c.min_processes,
            ),
            avoid,
        )

    def warm(self, argv: list[str], env: Mapping[str, str]) -> None:
        """Local mode with launch.standby: start the next attempt's processes now, to wait (once; `env`: the
        environment every attempt shares)."""
        if self.cfg.mode == "local" and self.cfg.standby and self._standby is None:
            cpus = [pinned(i, self.cfg.cpus_per_process) for i in range(self.cfg.processes)]
            self._standby = Standby(argv, env, processes=self.cfg.processes, cpus=cpus, run_dir=self._run_dir)

    def close(self) -> None:
        """The supervisor ends: standby processes are let go."""
        if self._standby is not None:
            self._standby.close()
            self._standby = None

    def start_guard(self, run_dir: Path, env: Mapping[str, str] = os.environ) -> None:
        """Under SLURM, once: the supervisor's lease, and a guard on every other node that requeues the job
        if the lease stops (the batch host lost: trainer.supervise.guard)."""
        if self.cfg.mode != "slurm" or self._guarded:
            return
        self._guarded, here = True, env.get(env_vars.SLURMD_NODENAME, "")
        guard.renew_forever(run_dir, here)
        if others := [n for n in self.allocated if n != here]:
            cmd = guard.srun_command(others, run_dir, self.job)
            self._guard = subprocess.Popen(
                cmd, env=guard.guard_env(env), preexec_fn=die_with_parent, start_new_session=True
            )

    def can_regrow(self) -> bool:
        """The group runs shrunk and a full-size one could start now (suspects due for a retry count)."""
        shrunk = isinstance(self._last, SrunGroup) and self._last.processes < self.cfg.processes
        return (
            shrunk
            and bool(self.cfg.suspect_retry_minutes)
            and self._plan(set(down_nodes(self.allocated)))[1] == self.cfg.processes
        )

    def drain_plan(self, node: str) -> int:
        """Processes the next attempt would run without `node` (a spare in its place, or a shrink that
        launch.min_processes allows); 0 when it cannot run without it (local mode, no spare, no shrink)."""
        if self.cfg.mode != "slurm" or not node:
            return 0
        nodes, n, _ = self._plan(set(down_nodes(self.allocated)), also={node})
        return 0 if node in nodes else n

    def describe(self) -> dict:
        """For the worker_start event: where this attempt runs, and which nodes it avoided."""
        info = self._last.describe() if self._last else {}
        return dict(info, suspect_nodes=sorted(self.suspects)) if self.suspects else info


def pinned(process: int, cpus: int) -> tuple[int, ...]:
    """launch.cpus_per_process: the CPUs local process `process` may run on (none: any)."""
    return tuple((process * cpus + j) % os.cpu_count() for j in range(cpus))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
