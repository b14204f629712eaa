"""Process-group membership: who this process is (explicit settings, a SLURM step, or alone) and where
its coordinator listens. No jax: the launcher and the workers use the same rules; joining the group is
trainer.core.distributed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from trainer.config import ConfigError, LaunchConfig

# Explicit settings: the local launcher sets these, and so can a user on any other launcher.
ENV_PROCESSES = "TRAINER_NUM_PROCESSES"
ENV_PROCESS_ID = "TRAINER_PROCESS_ID"
ENV_COORDINATOR = "TRAINER_COORDINATOR"  # host:port of process 0
ENV_PORT = "TRAINER_COORDINATOR_PORT"  # under SLURM: the port; the host is the step's first node
ENV_ATTEMPT = "TRAINER_ATTEMPT"  # set by the supervisor: restarts use a fresh coordinator port


@dataclass(frozen=True)
class Membership:
    processes: int
    process_id: int
    coordinator: str  # "" when alone
    source: str  # explicit | slurm | single


def first_host(nodelist: str) -> str:
    """First host of a SLURM hostlist: 'n1', 'n1,n2' -> 'n1'; 'gpu[003-010,012],cpu1' -> 'gpu003'."""
    i = next((k for k, ch in enumerate(nodelist) if ch in ",["), len(nodelist))
    if i == len(nodelist) or nodelist[i] == ",":
        return nodelist[:i]
    inside = nodelist[i + 1 :]
    return nodelist[:i] + inside[: next(k for k, ch in enumerate(inside) if ch in ",-]")]


def slurm_port(cfg: LaunchConfig, env: Mapping[str, str]) -> int:
    """Same on every task without talking: derived from the job id (or the configured base), plus the
    attempt, so a restarted step never waits for the killed coordinator's port."""
    base = cfg.coordinator_port or 20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000
    return base + int(env.get(ENV_ATTEMPT, "0")) % 1000


def in_slurm_step(env: Mapping[str, str]) -> bool:
    # The batch script has SLURM_JOB_ID and SLURM_NTASKS too, but it is one shell, not one task of many.
    return "SLURM_STEP_ID" in env and "SLURM_PROCID" in env and env.get("SLURM_STEP_ID") not in ("batch", "extern")


def detect(cfg: LaunchConfig, env: Mapping[str, str] = os.environ) -> Membership:
    if ENV_PROCESSES in env:
        n = int(env[ENV_PROCESSES])
        if n > 1 and not (env.get(ENV_PROCESS_ID) and env.get(ENV_COORDINATOR)):
            raise ConfigError(f"{ENV_PROCESSES}={n} also needs {ENV_PROCESS_ID} and {ENV_COORDINATOR} (host:port)")
        return Membership(n, int(env.get(ENV_PROCESS_ID, "0")), env.get(ENV_COORDINATOR, ""), "explicit")
    if in_slurm_step(env):
        n = int(env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"])
        port = int(env.get(ENV_PORT) or slurm_port(cfg, env))
        host = first_host(env["SLURM_STEP_NODELIST"])
        return Membership(n, int(env["SLURM_PROCID"]), f"{host}:{port}", "slurm")
    return Membership(1, 0, "", "single")
