"""Every XLA flag and environment variable the trainer sets for the accelerator stack, in this one place, each
with the reason beside it, each behind a typed config key (`run.*`). `apply` runs in every worker before jax
initialises its backends (trainer.__main__.configure_devices): XLA reads XLA_FLAGS once per process, when the
first compile options are built, and jax reads its client variables when the GPU client starts. `in_force` is
what a run records of them (its `compiled` event: trainer.train.loop).

A flag already in XLA_FLAGS stays: the user's own flags come first and are never dropped; ours are appended
once (a worker restarted in the same environment adds nothing). A key left at its default sets nothing, so
XLA's and jax's own defaults hold (the latency-hiding scheduler off, jax's 0.75 of GPU memory). No jax import.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import TYPE_CHECKING

from trainer.store import env_vars

if TYPE_CHECKING:
    from trainer.config import RunConfig

# run.deterministic: XLA's deterministic ops ("guarantees run-to-run determinism on GPU"; it implies
# --xla_gpu_exclude_nondeterministic_ops and makes scatters, e.g. the embedding gradient, deterministic).
# Bitwise resume on GPU needs it: without it, reductions that use atomics may differ in the last bit. It
# costs slower scatters (benchmarks/gpu_check.py prices it: the bitwise run's step time over the 124M run's).
DETERMINISTIC_FLAG = "--xla_gpu_deterministic_ops=true"
# run.xla_latency_hiding: XLA's latency-hiding scheduler orders asynchronous collectives and copies so they
# overlap compute (MaxText's GPU recipes turn it on). Off in XLA by default. It has collectives to hide with
# FSDP over several GPUs, few on one GPU; benchmarks/gpu_check.py measures the 124M step with it on and off.
LATENCY_HIDING_FLAG = "--xla_gpu_enable_latency_hiding_scheduler=true"


def xla_flags(run: RunConfig) -> list[str]:
    """The XLA flags these `run.*` keys ask for."""
    wanted = ((run.deterministic, DETERMINISTIC_FLAG), (run.xla_latency_hiding, LATENCY_HIDING_FLAG))
    return [flag for on, flag in wanted if on]


def apply(run: RunConfig, environ: MutableMapping[str, str] = os.environ) -> None:
    """Set what `run.*` asks for in `environ`, before jax starts."""
    have = environ.get(env_vars.XLA_FLAGS, "")
    if add := [f for f in xla_flags(run) if f not in have.split()]:
        environ[env_vars.XLA_FLAGS] = " ".join([have, *add]).strip()
    # run.gpu_mem_fraction: the share of each GPU's memory jax's allocator takes at start (jax's default 0.75,
    # which leaves a quarter for other processes). A ~1B model without remat on one GPU needs more of it
    # (benchmarks/gpu_check.py runs at 0.92); a GPU shared with another process needs less. 0 leaves jax's
    # default, or the variable as the user set it.
    if run.gpu_mem_fraction:
        environ[env_vars.XLA_PYTHON_CLIENT_MEM_FRACTION] = f"{run.gpu_mem_fraction:g}"


def in_force(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """What this process's accelerator stack runs with: XLA_FLAGS (ours and the user's) and the GPU memory
    fraction ("" where unset: the library's default)."""
    return {
        "xla_flags": environ.get(env_vars.XLA_FLAGS, ""),
        "gpu_mem_fraction": environ.get(env_vars.XLA_PYTHON_CLIENT_MEM_FRACTION, ""),
    }
