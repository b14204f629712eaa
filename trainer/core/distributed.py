"""Joining the jax.distributed group this process belongs to (membership: trainer.supervise.membership),
with CPU collectives over gloo in test mode."""

from __future__ import annotations

from trainer.config import LaunchConfig
from trainer.supervise.membership import Membership, detect


def initialize(cfg: LaunchConfig, *, cpu: bool) -> Membership:
    """Join the process group when this is one of several processes; a no-op for a single one.
    Must run before anything initialises a jax backend."""
    me = detect(cfg)
    if me.processes <= 1:
        return me
    import jax

    if cpu:  # fake CPU devices in several processes talk through gloo over TCP
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=me.coordinator, num_processes=me.processes,
                               process_id=me.process_id, initialization_timeout=cfg.init_timeout_s)
    return me
