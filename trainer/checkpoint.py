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


def _preservation(cfg: CheckpointConfig, pinned: Callable[[], set[int]] | None):
    policies: list = [cm.LatestN(cfg.keep_latest)]
    if cfg.keep_every:
        policies.append(cm.EveryNSteps(cfg.keep_every))
    if pinned is not None:
        policies.append(_Pinned(pinned))
    return cm.AnyPreservationPolicy(policies)


class _Pinned(cm.PreservationPolicy):
    """Keeps steps someone else needs (the runbook's last-known-good checkpoint)."""

    def __init__(self, pinned: Callable[[], set[int]]):
        self._pinned = pinned

    def should_preserve(self, checkpoints, *, context):
        keep = self._pinned()
        return [c.step in keep for c in checkpoints]


class Checkpointer:
    def __init__(self, directory: Path, cfg: CheckpointConfig, *,
                 pinned: Callable[[], set[int]] | None = None, read_only: bool = False):
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
                continue
            return Restored(step, out["state"], out["data"], out["meta"])
        return None

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
