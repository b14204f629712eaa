"""Checkpoint tiers: the durable one (`RUN_DIR/checkpoints`, shared, `checkpoint.every_*`) and an optional
node-local one (`checkpoint.local_*`: each process its own directory, uncompressed, full state), and the
restore that picks the newest checkpoint every process holds and can verify, across both.

Every verdict is agreed before anything moves: each process checks its share, the results are gathered,
and all processes reject (move aside) or use a checkpoint together, so a bad file seen by one process
never leaves another waiting in a barrier.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from trainer.config import CheckpointConfig
from trainer.core.checkpoint import Checkpointer, Restored, SaveFailed
from trainer.core.distributed import allgather_json
from trainer.observe import checkpoint_files, manifest
from trainer.observe.checkpoint_files import DURABLE, LOCAL
from trainer.observe.event_names import CHECKPOINT_FAILED, CHECKPOINT_REJECTED


def saved_meta(run_dir: Path, cfg: CheckpointConfig) -> dict | None:
    """The metadata item of the newest checkpoint (either tier) whose metadata reads: what a resume is
    checked against before anything is written. A torn one is skipped here; the restore rejects it."""
    dirs = [checkpoint_files.durable_dir(run_dir)]
    if cfg.local_dir:
        dirs.append(checkpoint_files.local_dir(cfg.local_dir, run_dir, jax.process_index()))
    found: list[tuple[int, Checkpointer]] = []
    for d, tier in zip(dirs, (DURABLE, LOCAL)):
        if d.is_dir():
            reader = Checkpointer(d, cfg, tier=tier, read_only=True)
            found += [(s, reader) for s in reader.steps()]
    for step, reader in sorted(found, key=lambda f: f[0], reverse=True):
        try:
            return reader.read_meta(step)
        except Exception:  # torn or corrupt: an older one answers the same question
            continue
    return None


class Tiers:
    """What the loop saves into and restores from. `log` writes events (process 0's event log)."""

    def __init__(
        self,
        run_dir: Path,
        cfg: CheckpointConfig,
        *,
        log: Callable[..., None],
        pinned: Callable[[list[int]], set[int]] | None,
        rewinds: list[int],
        commit_delay: Callable[[int], float] | None = None,
    ):
        self.cfg, self.log = cfg, log
        self.run_dir = Path(run_dir)
        self.durable = Checkpointer(
            checkpoint_files.durable_dir(self.run_dir), cfg, pinned=pinned, commit_delay=commit_delay
        )
        self.local: Checkpointer | None = None
        if cfg.local_dir:
            self.local = Checkpointer(
                checkpoint_files.local_dir(cfg.local_dir, run_dir, jax.process_index()), cfg, tier=LOCAL
            )
        # The runbook's rewind targets, oldest first: a local checkpoint saved before the i-th rewind and past
        # its target belongs to an abandoned history (the supervisor cannot reach node-local disks to move it).
        self.rewinds = rewinds

    # --- saving ---------------------------------------------------------------------------------------
    @property
    def has_local(self) -> bool:
        """A local tier is configured and has not failed in this attempt."""
        return self.local is not None

    def save(self, step: int, state: Any, data_state: dict, meta: dict, *, tier: str) -> float | None:
        """Start an async save into one tier; blocking seconds. A durable failure raises SaveFailed; a local
        one (None) turns the local tier off for this attempt (the durable tier still protects the run)."""
        meta = dict(meta, lineage=len(self.rewinds))
        if tier == DURABLE:
            return self.durable.save(step, state, data_state, meta)
        try:
            return self.local.save(step, state, data_state, meta)
        except SaveFailed:
            self._local_failed()
            return None

    def failure(self) -> str | None:
        """A durable save that could not be written (checked every step; a local one is handled here)."""
        if self.local and self.local.failure:
            self._local_failed()
        return self.durable.failure

    def _local_failed(self) -> None:
        self.log(CHECKPOINT_FAILED, tier=LOCAL, message=self.local.failure, action="local tier off until restart")
        self.local = None

    def close(self) -> None:
        for ck in (self.local, self.durable):
            if ck:
                ck.close()

    # --- restoring ------------------------------------------------------------------------------------
    def restore_newest(self, abstract_state: Any, *, layout: dict) -> Restored | None:
        """The newest checkpoint that every process holds and verifies, across both tiers (at one step the
        local copy wins: it reads fastest). Bad ones are rejected with an event and moved aside."""
        while (cand := self._newest(layout)) is not None:
            step, tier = cand
            ck = self.local if tier == LOCAL else self.durable
            problem = self._agreed(lambda ck=ck, step=step: ck.verify(step) if self.cfg.verify else None)
            restored = None
            if problem is None:
                restored, problem = self._restore(ck, step, abstract_state)
            if problem is None:
                return restored
            self.log(CHECKPOINT_REJECTED, step=step, tier=tier, **problem)
            self._move_aside(ck, step)
        return None

    def _newest(self, layout: dict) -> tuple[int, str] | None:
        views = allgather_json({DURABLE: self.durable.steps(), LOCAL: self._usable_local(layout)})
        common = lambda tier: set.intersection(*(set(v[tier]) for v in views))  # noqa: E731
        cands = [(s, LOCAL) for s in common(LOCAL)] + [(s, DURABLE) for s in common(DURABLE)]
        return max(cands, key=lambda c: (c[0], c[1] == LOCAL), default=None)

    def _usable_local(self, layout: dict) -> list[int]:
        """Local steps this process could restore: same mesh and process count (a local checkpoint holds
        this process's shards only) and not from a history the runbook rewound away from. A step whose
        metadata does not read stays a candidate: verification rejects it with an event."""
        if not self.local:
            return []
        out = []
        for step in self.local.steps():
            try:
                meta = self.local.read_meta(step)
            except Exception:
                out.append(step)
                continue
            stale = any(to < step for to in self.rewinds[int(meta.get("lineage", 0)) :])
            if not stale and meta.get("processes") == layout["processes"] and meta.get("mesh") == layout["mesh"]:
                out.append(step)
        return out

    def _agreed(self, check: Callable[[], manifest.Problem | None]) -> dict | None:
        """Run a check on every process; the first problem any process found, or None: the same on all."""
        try:
            p = check()
            mine = None if p is None else {"file": p.file, "reason": p.reason}
        except Exception as e:  # a check that itself failed is a verdict against the checkpoint
            mine = {"file": "", "reason": f"check failed: {e!r}"[:300]}
        for i, verdict in enumerate(allgather_json(mine)):
            if verdict is not None:
                return dict(verdict, process=i)
        return None

    def _restore(self, ck: Checkpointer, step: int, abstract_state: Any) -> tuple[Restored | None, dict | None]:
        restored: list[Restored] = []

        def load() -> None:
            restored.append(manifest.retrying(lambda: ck.restore(step, abstract_state)))

        def check() -> manifest.Problem | None:
            try:
                load()
            except Exception as e:  # unreadable: torn, corrupt, or written by something else
                return manifest.Problem("", f"unreadable: {e!r}"[:300])
            return None

        problem = self._agreed(check)
        return (restored[0] if problem is None else None), problem

    def _move_aside(self, ck: Checkpointer, step: int) -> None:
        """Durable: process 0 moves the shared directory; local: each process its own copy. Then everyone
        waits for everyone and re-reads its listing."""
        stamp = int(time.time())
        if ck.tier == LOCAL:
            ck.move_aside(step, checkpoint_files.local_rejected_path(ck.directory, step, stamp))
        elif jax.process_index() == 0:
            ck.move_aside(step, checkpoint_files.rejected_path(self.run_dir, step, stamp))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"reject-{ck.tier}-{step}")
        ck.reload()
