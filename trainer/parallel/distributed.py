"""Joining the jax.distributed group this process belongs to (membership: trainer.store.membership),
with CPU collectives over gloo in test mode."""

from __future__ import annotations

import json
import socket
import time
import warnings

from trainer.config import LaunchConfig
from trainer.store.membership import Membership, detect


def initialize(cfg: LaunchConfig, *, cpu: bool) -> Membership:
    """Join the process group when this is one of several processes; a no-op for a single one.
    Must run before anything initialises a jax backend."""
    me = detect(cfg)
    if me.processes <= 1:
        return me
    import jax

    if cpu:  # fake CPU devices in several processes talk through gloo over TCP
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if me.process_id != 0:
        _wait_for_coordinator(me.coordinator, cfg.init_timeout_s)
    jax.distributed.initialize(
        coordinator_address=me.coordinator,
        num_processes=me.processes,
        process_id=me.process_id,
        initialization_timeout=cfg.init_timeout_s,
    )
    return me


def _wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Until process 0's coordination service listens. jax's client dials once and, refused (the service is not
    up yet: every process of a restart starts at once), waits gRPC's reconnect backoff, about a second, before
    it dials again: downtime in every restart, at any scale (docs/multihost.md has the number). A TCP connect
    every 10 ms costs nothing. Gives up silently at the timeout: jax's own then reports."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.01)


def allgather_json(obj, *, limit: int = 1 << 16) -> list:
    """Every process's `obj` (JSON-able, at most `limit` bytes encoded), in process order: how processes
    agree on verdicts that are not flags (which checkpoint, which file is bad). One host collective."""
    import jax

    if jax.process_count() == 1:
        return [obj]
    import numpy as np
    from jax.experimental import multihost_utils

    raw = json.dumps(obj).encode()
    assert len(raw) <= limit, f"allgather_json: {len(raw)} bytes > {limit}"
    buf = np.zeros(limit + 4, np.uint8)
    buf[:4] = np.frombuffer(len(raw).to_bytes(4, "little"), np.uint8)
    buf[4 : 4 + len(raw)] = np.frombuffer(raw, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(buf)).reshape(jax.process_count(), limit + 4)
    return [json.loads(bytes(r[4 : 4 + int.from_bytes(bytes(r[:4]), "little")])) for r in rows]


def cache_every_processes_executables() -> None:
    """On XLA:CPU, let every process of a group write its own executables to the persistent compilation cache,
    as process 0 does. jax writes the cache from process 0 only, so that processes do not contend for one
    entry: on GPUs every process's key is the same (jax strips the device assignment from it), and process 0's
    entry is the one every process loads at a restart. XLA:CPU keys each process's executable by its own
    topology, so no entry but process 0's is ever written, and every other process compiles the whole step
    again at every restart (most of its restart's CPU time: docs/multihost.md). That is a cost the GPU restart
    this CPU group stands in for does not have: with this, a CPU group's restart loads every process's step as
    a GPU group's does (each process its own key, so still no contention).
    Touches jax's private compiler._cache_write, checked against jax 0.10.2; if its signature moves, nothing is
    changed (restarts only compile as before)."""
    import inspect

    from jax._src import compilation_cache, compiler
    from jax._src.distributed import global_state

    write = compiler._cache_write
    expected = ["cache_key", "compile_time_secs", "module_name", "backend", "executable", "host_callbacks"]
    if getattr(write, "every_process", False) or list(inspect.signature(write).parameters) != expected:
        return

    def cache_write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
        if global_state.process_id == 0 or host_callbacks:  # jax's own rules: process 0, no host callbacks
            return write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)
        try:
            compilation_cache.put_executable_and_time(
                cache_key, module_name, executable, backend, int(compile_time_secs)
            )
        except Exception as e:  # as jax treats a failed write: a warning, the run goes on
            warnings.warn(f"writing the compilation cache entry for {module_name!r} failed: {e}", stacklevel=2)

    cache_write.every_process = True
    compiler._cache_write = cache_write


def coordination_client():
    """The jax.distributed coordination service's client (its key-value store carries the loop's agreed
    flags, trainer.parallel.agree). jax keeps it in a private module, checked against jax 0.10.2; the public API
    exposes initialize/shutdown but not the client. (The only other private jax names we use are in
    cache_every_processes_executables.)"""
    from jax._src.distributed import global_state

    return global_state.client
