"""Multi-process initialisation (SLURM or explicit settings) and who the primary process is."""

from __future__ import annotations

import os


def initialize() -> None:
    """Join the process group when launched as one of several processes; no-op for a single one."""
    n = int(os.environ.get("TRAINER_NUM_PROCESSES", "1"))
    if n <= 1:
        return
    import jax

    jax.distributed.initialize(
        coordinator_address=os.environ["TRAINER_COORDINATOR"],
        num_processes=n,
        process_id=int(os.environ["TRAINER_PROCESS_ID"]),
    )
