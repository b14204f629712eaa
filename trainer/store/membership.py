"""Process-group membership: who this process is (explicit settings, a SLURM step, or alone) and where
its coordinator listens. No jax: the launcher and the workers use the same rules; joining the group is
trainer.parallel.distributed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from trainer.config import ConfigError, LaunchConfig
from trainer.store import env_vars


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


# Derived coordinator ports stay in [20000, 32768): below Linux's ephemeral range (ip_local_port_range starts
# at 32768), where any outgoing connection on the coordinator's host may hold the port: the coordinator then
# fails to start and its node is blamed (docs/multihost.md).
PORT_LOW, PORT_HIGH = 20000, 32768


def slurm_port(cfg: LaunchConfig, env: Mapping[str, str]) -> int:
    """Same on every task without talking: derived from the job id (or the configured base), plus the
    attempt, so a restarted step never waits for the killed coordinator's port."""
    attempt = int(env.get(env_vars.ATTEMPT, "0"))
    if cfg.coordinator_port:
        return cfg.coordinator_port + attempt % 1000
    job = int(env.get(env_vars.SLURM_JOB_ID, "0"))
    return PORT_LOW + (job + attempt) % (PORT_HIGH - PORT_LOW)


def in_slurm_step(env: Mapping[str, str]) -> bool:
    # The batch script has SLURM_JOB_ID and SLURM_NTASKS too, but it is one shell, not one task of many.
    return (
        env_vars.SLURM_STEP_ID in env
        and env_vars.SLURM_PROCID in env
        and env.get(env_vars.SLURM_STEP_ID) not in ("batch", "extern")
    )


def detect(cfg: LaunchConfig, env: Mapping[str, str] = os.environ) -> Membership:
    if env_vars.NUM_PROCESSES in env:
        n = int(env[env_vars.NUM_PROCESSES])
        if n > 1 and not (env.get(env_vars.PROCESS_ID) and env.get(env_vars.COORDINATOR)):
            raise ConfigError(
                f"{env_vars.NUM_PROCESSES}={n} also needs {env_vars.PROCESS_ID} and {env_vars.COORDINATOR} (host:port)"
            )
        return Membership(n, int(env.get(env_vars.PROCESS_ID, "0")), env.get(env_vars.COORDINATOR, ""), "explicit")
    if in_slurm_step(env):
        n = int(env.get(env_vars.SLURM_STEP_NUM_TASKS) or env[env_vars.SLURM_NTASKS])
        port = int(env.get(env_vars.COORDINATOR_PORT) or slurm_port(cfg, env))
        host = first_host(env[env_vars.SLURM_STEP_NODELIST])
        return Membership(n, int(env[env_vars.SLURM_PROCID]), f"{host}:{port}", "slurm")
    return Membership(1, 0, "", "single")
