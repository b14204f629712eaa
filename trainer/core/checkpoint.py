"""Orbax checkpoints of the whole run: state (params, optimizer, step, PRNG), data cursor, metadata.

Saves are async: `save` returns once device arrays are copied to host, and a background thread
writes them; Orbax commits each step directory atomically, so a crash mid-write leaves only a tmp
directory that is never restored. Restore verifies by reading: a checkpoint that fails to load is
reported and the next older one is tried.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as cm

from trainer.config import CheckpointConfig

ITEMS = ("state", "data", "meta")


@dataclass
class Restored:
    step: int
    state: Any
    data_state: dict
    meta: dict


def _preservation(cfg: CheckpointConfig, pinned: Callable[[list[int]], set[int]] | None):
    policies: list = [cm.LatestN(cfg.keep_latest)]
    if cfg.keep_every:
        policies.append(cm.EveryNSteps(cfg.keep_every))
    if pinned is not None:
        policies.append(_Pinned(pinned))
    return cm.AnyPreservationPolicy(policies)


class _Pinned(cm.PreservationPolicy):
    """Keeps steps someone else needs (the runbook's last-known-good checkpoint and rewind target): the
    callable gets the steps that exist, newest included, and returns those to keep."""

    def __init__(self, pinned: Callable[[list[int]], set[int]]):
        self._pinned = pinned

    def should_preserve(self, checkpoints, *, context):
        keep = self._pinned(sorted(c.step for c in checkpoints))
        return [c.step in keep for c in checkpoints]


class SavePolicy:
    """When to save: every N steps and/or every M minutes. M = "auto" re-derives the interval after
    each save from the measured blocking time and the failure rate of the cluster (run-survival model)."""

    def __init__(self, cfg: CheckpointConfig, *, devices: int, restart_s: float):
        self._cfg, self._devices, self._restart_s = cfg, cfg.auto_devices or devices, restart_s
        self.minutes = 0.0 if cfg.every_minutes == "auto" else float(cfg.every_minutes)
        self._last = time.time()

    def due(self, step: int) -> tuple[bool, bool]:
        """(periodic by steps, due by time)."""
        by_steps = bool(self._cfg.every_steps) and step % self._cfg.every_steps == 0
        return by_steps, bool(self.minutes) and time.time() - self._last >= 60 * self.minutes

    def saved(self, blocking_s: float) -> float | None:
        """Record a save; returns the new interval in minutes when "auto" changed it."""
        self._last = time.time()
        if self._cfg.every_minutes != "auto":
            return None
        from trainer.survival.model import recommend_interval_min

        self.minutes = recommend_interval_min(stall_s=max(blocking_s, 1e-3), restart_s=self._restart_s,
                                              gpus=self._devices, mtbf_hours=self._cfg.mtbf_hours)
        return self.minutes


class Checkpointer:
    def __init__(self, directory: Path, cfg: CheckpointConfig, *,
                 pinned: Callable[[list[int]], set[int]] | None = None, read_only: bool = False):
        options = ocp.CheckpointManagerOptions(
            preservation_policy=None if read_only else _preservation(cfg, pinned),
            enable_async_checkpointing=cfg.async_save,
            create=not read_only,
            read_only=read_only,
            cleanup_tmp_directories=not read_only,
        )
        self.manager = ocp.CheckpointManager(Path(directory).absolute(), options=options, item_names=ITEMS)

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: Any, data_state: dict, meta: dict) -> float:
        """Start a save; returns the seconds it blocked the caller (the device-to-host copy)."""
        t0 = time.perf_counter()
        self.manager.save(step, force=True, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            # The data cursor is identical on every process (it is the step), so one JSON written by
            # the primary suffices and stays valid when the process count changes (elastic resume).
            data=ocp.args.JsonSave(data_state),
            meta=ocp.args.JsonSave(meta),
        ))
        return time.perf_counter() - t0

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def read_meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def restore_newest(self, abstract_state: Any, on_error: Callable[[int, Exception], None]) -> Restored | None:
        """Newest checkpoint that loads; older ones are tried when a newer one is unreadable."""
        for step in reversed(self.steps()):
            try:
                out = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state),
                    data=ocp.args.JsonRestore(),
                    meta=ocp.args.JsonRestore(),
                ))
            except Exception as e:  # a torn or corrupt checkpoint: fall back to the previous one
                on_error(step, e)
                self._quarantine(step)
                continue
            return Restored(step, out["state"], out["data"], out["meta"])
        return None

    def _quarantine(self, step: int) -> None:
        """Move an unreadable checkpoint aside (kept for a post-mortem), so that the resumed run can
        write that step again."""
        import jax

        src = Path(self.manager.directory) / str(step)
        if jax.process_index() == 0 and src.exists():
            dst = src.parent.parent / "unreadable_checkpoints" / f"{step}-{int(time.time())}"
            dst.parent.mkdir(exist_ok=True)
            src.rename(dst)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"quarantine-{step}")
        self.manager.reload()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
