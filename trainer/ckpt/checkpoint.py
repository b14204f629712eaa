"""Orbax checkpoints of the whole run, one tier per `Checkpointer`: state (params, optimizer, step, PRNG),
data cursor, metadata. When to save: trainer.ckpt.save_policy; the files on disk: trainer.store.ckpt_files.

Saves are async: `save` returns once device arrays are copied to host; Orbax writes and commits the step
directory atomically in the background, and then a sealing thread checksums what this process committed
and writes its manifest into the step directory (trainer.store.manifest): the training thread never
hashes. Retention never deletes the newest sealed checkpoint before a newer one is sealed. A failed write
(disk full, I/O error) is kept in `failure` for the loop to act on. Choosing, verifying and restoring
across tiers: trainer.ckpt.tiers.
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as cm

from trainer.config import CheckpointConfig
from trainer.parallel.distributed import allgather_json
from trainer.store import bucket, manifest
from trainer.store import ckpt_files as checkpoint_files
from trainer.store.ckpt_files import BUDDY, DATA, DURABLE, ITEMS, LOCAL, META, STATE, Meta

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class SaveFailed(RuntimeError):
    """A checkpoint could not be written (disk full, write error); the message says what to do."""


@dataclass
class Restored:
    step: int
    state: Any
    data_state: dict
    meta: Meta
    tier: str
    sources: dict | None = None  # a local restore: for each process, which process (node) gave its shards


@dataclass(frozen=True)
class Verdict:
    """The group's verdict on a checkpoint (`agreed`): sound, or the first problem any process found (its file
    and reason) and which process found it, so that the one holding a bad local copy moves it aside."""

    problem: manifest.Problem | None = None
    process: int | None = None

    @property
    def ok(self) -> bool:
        return self.problem is None

    def fields(self) -> dict:
        """What the checkpoint_rejected event says of the problem."""
        return {"file": self.problem.file, "reason": self.problem.reason, "process": self.process}


def _preservation(keep: int, keep_every: int, pinned: Callable[[list[int]], set[int]]):
    policies: list = [cm.LatestN(keep), _Pinned(pinned)]
    if keep_every:
        policies.append(cm.EveryNSteps(keep_every))
    return cm.AnyPreservationPolicy(policies)


class _Pinned(cm.PreservationPolicy):
    """Keeps steps someone else needs (the newest sealed checkpoint, the runbook's last-known-good one and
    rewind target): the callable gets the steps that exist, newest included, and returns those to keep."""

    def __init__(self, pinned: Callable[[list[int]], set[int]]):
        self._pinned = pinned

    def should_preserve(self, checkpoints, *, context):
        keep = self._pinned(sorted(c.step for c in checkpoints))
        return [c.step in keep for c in checkpoints]


def _local_multiprocessing() -> ocp.options.MultiprocessingOptions:
    """A local checkpoint involves this process alone: no primary host, no barriers with the others."""
    return ocp.options.MultiprocessingOptions(
        primary_host=None,
        active_processes={jax.process_index()},
        barrier_sync_key_prefix=f"local-{jax.process_index()}",
    )


def _local_handlers(mp: ocp.options.MultiprocessingOptions) -> dict:
    """The local tier: each process writes every shard it holds (one copy per index) into its own directory,
    uncompressed (what Orbax's emergency checkpointing does for its local tier), and its own JSON items."""
    registry = ocp.type_handlers.create_type_handler_registry(
        (jax.Array, ocp.type_handlers.ArrayHandler(primary_host=None, replica_id=None, use_replica_parallel=False))
    )
    tree = lambda: ocp.PyTreeCheckpointHandler(  # noqa: E731
        use_compression=False, multiprocessing_options=mp, type_handler_registry=registry
    )
    return {
        STATE: tree(),
        BUDDY: tree(),  # another process's shards, held for it (trainer.ckpt.buddy)
        DATA: ocp.JsonCheckpointHandler(multiprocessing_options=mp),
        META: ocp.JsonCheckpointHandler(multiprocessing_options=mp),
    }


def _single_process_writes() -> None:
    """One process: durable saves write each replicated array from its first replica, as Orbax itself does on
    GPU (jax_array_handlers._get_default_use_replica_parallel: off when JAX_PLATFORMS names gpu or cuda).
    Replica-parallel writes spread a replicated array's bytes over the processes holding it; within one
    process there is nothing to spread, and on CPU (where Orbax leaves it on) the split only adds a compiled
    slice per array shape to every restart's first save. Several processes keep Orbax's default."""
    ocp.type_handlers.register_type_handler(
        jax.Array,
        ocp.type_handlers.ArrayHandler(use_replica_parallel=False, array_metadata_store=_array_metadata_store()),
        override=True,
    )


def _array_metadata_store():
    """Orbax's own array-metadata store, which its default ArrayHandler writes through. The one private
    Orbax name we use (checked against orbax-checkpoint 0.12.8): the public API exports the handler but not
    the store, and a handler built without it would stop writing the per-array metadata Orbax's restore
    reads (its default handler passes this same store)."""
    from orbax.checkpoint._src.metadata import array_metadata_store

    return array_metadata_store.Store()


def _slow_commits(delay_s: Callable[[int], float]) -> type:
    """The slow_save fault's storage: Orbax's own atomic rename of the step directory, `delay_s(step)` seconds
    late. Orbax commits in its background thread when saves are async, in the caller's thread otherwise."""

    class SlowCommit(ocp.path.atomicity.AtomicRenameTemporaryPath):
        async def finalize(self):
            if (name := self.get_final().name).isdigit():  # the step directory (its items use this class too)
                await asyncio.sleep(delay_s(int(name)))
            await super().finalize()

    return SlowCommit


class Checkpointer:
    """One tier's Orbax manager. `tier` DURABLE: shared storage, one checkpoint written by all processes
    together. LOCAL: this process's own directory on node-local storage."""

    def __init__(
        self,
        directory: Path,
        cfg: CheckpointConfig,
        *,
        tier: str = DURABLE,
        pinned: Callable[[list[int]], set[int]] | None = None,
        read_only: bool = False,
        commit_delay: Callable[[int], float] | None = None,
        remote: str | None = None,
    ):
        """`remote`: a bucket URL (durable tier): `directory` stages its steps (trainer.store.bucket)."""
        self.cfg, self.tier = cfg, tier
        self.bucket = bucket.Bucket(remote, cfg.bucket_patience_s) if remote else None
        self.directory = Path(directory).absolute()
        local = tier == LOCAL
        # Manifest identity: a local checkpoint is one process's own; a durable one is shared by all.
        self.writer, self.writers = (0, 1) if local else (jax.process_index(), jax.process_count())
        self.failure: str | None = None  # set when a save could not be written
        self._fail_next: OSError | None = None  # a fault's error for the next save (fail_next_save)
        self._sealer: threading.Thread | None = None
        self._pinned = pinned
        extra: dict = {}
        if local:
            if not read_only:
                self.directory.mkdir(parents=True, exist_ok=True)  # Orbax creates no per-process root itself
            extra = dict(
                multiprocessing_options=_local_multiprocessing(),
                enable_per_process_directory_creation=True,
                save_root_metadata=False,
            )
        keep, keep_every = cfg.keep_latest, 0 if local else cfg.keep_every
        self._policy = None if read_only else _preservation(keep, keep_every, self._pins)
        options = ocp.CheckpointManagerOptions(
            preservation_policy=self._policy,
            enable_async_checkpointing=cfg.async_save,
            create=not read_only and not local,
            read_only=read_only,
            cleanup_tmp_directories=not read_only,
            temporary_path_class=_slow_commits(commit_delay) if commit_delay else None,
            **extra,
        )
        items = dict(item_names=ITEMS)
        if local:
            items = dict(item_handlers=_local_handlers(extra["multiprocessing_options"]))
        elif jax.process_count() == 1:
            _single_process_writes()
        self.manager = ocp.CheckpointManager(self.directory, options=options, **items)

    def _pins(self, steps: list[int]) -> set[int]:
        """The newest sealed checkpoint stays until a newer one is sealed (plus whatever the runbook pins)."""
        keep = set(self._pinned(steps)) if self._pinned else set()
        if self.cfg.verify:
            keep.update([s for s in steps if manifest.sealed(self.step_dir(s))][-1:])
        return keep

    def steps(self) -> list[int]:
        """The committed steps (in a bucket: the sealed ones, the only ones a restore may take)."""
        if self.bucket is not None:
            return [s for s, ok in self.bucket.steps().items() if ok]
        return checkpoint_files.committed_steps(self.directory)

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def fail_next_save(self, error: OSError) -> None:
        """The next save raises `error` where Orbax's write would (the disk_full fault): it fails as a full disk
        fails it, through the same description and `failure`."""
        self._fail_next = error

    def save(self, step: int, state: Any, data_state: dict, meta: dict, *, held: Any = None) -> float:
        """Start a save; returns the seconds it blocked the caller (the device-to-host copy). `held`: another
        process's shards this process keeps a copy of (local tier; trainer.ckpt.buddy)."""
        self._join_sealer()
        if self.failure:
            raise SaveFailed(self.failure)
        # The state is the output of the step still in flight. Orbax's copy would wait for it inside the
        # timed call, and the blocking figure (events, TensorBoard, goodput's checkpoint share, the "auto"
        # interval) would charge the step's own compute to the save.
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        extra = {}
        if self.tier == LOCAL:
            state_arg = ocp.args.PyTreeSave(state)
            if held is not None:
                jax.block_until_ready(held)
                extra[BUDDY] = ocp.args.PyTreeSave(held)
        else:
            state_arg = ocp.args.StandardSave(state)
        try:
            if self._fail_next is not None:
                error, self._fail_next = self._fail_next, None
                raise error
            self.manager.save(
                step,
                force=True,
                args=ocp.args.Composite(
                    **{STATE: state_arg},
                    **extra,
                    # The data cursor is identical on every process (it is the step), so one JSON written by
                    # the primary suffices and stays valid when the process count changes (elastic resume).
                    **{DATA: ocp.args.JsonSave(data_state), META: ocp.args.JsonSave(meta)},
                ),
            )
        except Exception as e:
            self.failure = self._describe(step, e)
            raise SaveFailed(self.failure) from e
        blocking = time.perf_counter() - t0
        self._sealer = threading.Thread(target=self._seal, args=(step,), name=f"seal-{self.tier}-{step}", daemon=True)
        self._sealer.start()
        return blocking

    def _seal(self, step: int) -> None:
        """Off the training thread: wait for Orbax's commit, then checksum what this process wrote."""
        try:
            self.manager.wait_until_finished()
            if self.cfg.verify:
                manifest.write(
                    self.step_dir(step), process=self.writer, processes=self.writers, durable=self.tier == DURABLE
                )
            if self.bucket is not None:
                self.bucket.upload(self.step_dir(step), self.writer)
                if self.writer == 0:
                    self._prune_bucket()
        except BaseException as e:  # reported through `failure`, acted on by the loop
            self.failure = self._describe(step, e)

    def _prune_bucket(self) -> None:
        """Retention in the bucket (process 0, after its upload): the same policy over the bucket's steps, the
        newest sealed one always kept; a step that never sealed and is older than it (a torn save) goes;
        newer ones may still be uploading."""
        listing = self.bucket.steps()
        sealed = [s for s, ok in listing.items() if ok]
        if not sealed or self._policy is None:
            return
        steps = [s for s in listing if s <= sealed[-1]]
        keep = self._policy.should_preserve([_Info(s) for s in steps], context=cm.PreservationContext())
        for s, kept in zip(steps, keep):
            if s != sealed[-1] and (not kept or not listing[s]):
                self.bucket.delete(s)

    def _join_sealer(self) -> None:
        if self._sealer is not None:
            self._sealer.join()
            self._sealer = None

    def _describe(self, step: int | None, e: BaseException) -> str:
        """What failed and what to do; `step` None: not one save's (closing the manager)."""
        chain, x = [], e
        while x is not None and len(chain) < 10:
            chain.append(x)
            x = x.__cause__ or x.__context__
        full = any(isinstance(x, OSError) and x.errno in _NO_SPACE for x in chain) or any(
            "No space left" in str(x) or "Disk quota" in str(x) for x in chain
        )
        what = "the disk is full" if full else "a write failed"
        where = self.directory if self.bucket is None else f"{self.bucket.loc} (staged in {self.directory})"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        of = "" if step is None else f" of step {step}"
        return (
            f"the {self.tier} checkpoint{of} could not be written to {where}: {what} "
            f"({type(e).__name__}: {first}). Earlier checkpoints are untouched; free space or fix the storage, "
            f"then rerun the same command to resume."
        )

    def restore(self, step: int, abstract_state: Any, *, meta: Callable[[], Meta], item: str = STATE) -> Restored:
        """The step's state (or, local tier, `item` BUDDY: the copy held for another process) and data cursor,
        the arrays landing with `abstract_state`'s shardings; its metadata from `meta` (read once per restore,
        trainer.ckpt.tiers), after Orbax's read, which every process of a durable restore takes part in."""
        if self.tier == LOCAL:
            state_arg = ocp.args.PyTreeRestore(
                abstract_state, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state)
            )
        else:
            state_arg = ocp.args.StandardRestore(abstract_state)
        out = self.manager.restore(step, args=ocp.args.Composite(**{item: state_arg, DATA: ocp.args.JsonRestore()}))
        return Restored(step, out[item], out[DATA], meta(), self.tier)

    def verify(self, step: int) -> manifest.Problem | None:
        """This process's share of re-reading the step's files against their manifests: in the durable
        tier manifest i is checked by process i mod (process count), so the work is spread whatever the
        process count was at save; a local checkpoint is checked whole by its owner."""
        share = None if self.tier == LOCAL else (jax.process_index(), jax.process_count())
        return manifest.verify(self.step_dir(step), share=share)

    def fetch(self, step: int) -> None:
        """A bucket's step into the staging directory, this process's share of it (then the group's verify and
        Orbax's read find it there). A failure raises: the storage's, never a verdict against the step."""
        if self.bucket is not None:
            self.bucket.download(step, self.step_dir(step), (jax.process_index(), jax.process_count()))

    def move_aside(self, step: int, dest: Path) -> None:
        """Keep a rejected checkpoint for a post-mortem, out of the way, so that the step can be written again."""
        src = self.step_dir(step)
        if src.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, dest)
        if self.bucket is not None:  # the staged copy kept aside; in the bucket it is deleted, manifests first
            self.bucket.delete(step)

    def reload(self) -> None:
        self.manager.reload()

    def wait(self) -> None:
        self.manager.wait_until_finished()
        self._join_sealer()

    def close(self) -> None:
        """Wait until every save is committed and sealed, then apply retention once more (Orbax applies it
        when a save starts, when the newest checkpoint was not sealed yet); a failure lands in `failure`."""
        self._join_sealer()
        try:
            self.manager.wait_until_finished()
            if self._policy is not None and not self.failure:
                if self.bucket is not None and self.writer == 0:
                    self._prune_bucket()
                infos = [_Info(s) for s in checkpoint_files.committed_steps(self.directory)]
                keep = self._policy.should_preserve(infos, context=cm.PreservationContext())
                for info, kept in zip(infos, keep):
                    if not kept:
                        self.manager.delete(info.step)
            self.manager.close()
        except Exception as e:  # the failure is reported through `failure`
            self.failure = self.failure or self._describe(None, e)


def agreed(check: Callable[[], manifest.Problem | None]) -> Verdict:
    """Run a check of a checkpoint on every process (each its share): the same verdict on all. A check that
    itself failed is a verdict against the checkpoint (every process still reaches the gather: none is left
    waiting in it). Each process's problem crosses as {file, reason} or null, converted here only."""
    try:
        p = check()
        mine = None if p is None else {"file": p.file, "reason": p.reason}
    except Exception as e:
        mine = {"file": "", "reason": f"check failed: {e!r}"[:300]}
    for i, theirs in enumerate(allgather_json(mine)):
        if theirs is not None:
            return Verdict(manifest.Problem(theirs["file"], theirs["reason"]), i)
    return Verdict()


@dataclass
class _Info:
    """What preservation policies read of a checkpoint (orbax's PolicyCheckpointInfo protocol)."""

    step: int
    metrics: dict | None = None
    time: Any = None
