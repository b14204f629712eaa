"""Checkpoint tiers: the durable one (`RUN_DIR/checkpoints`, shared, `checkpoint.every_*`) and an optional
node-local one (`checkpoint.local_*`: each process its own directory, uncompressed, full state, plus the
copy it holds for a process on another node: trainer.ckpt.buddy), and the restore that picks the newest
checkpoint the group can assemble and verify, across both: a local one may come from each process's own
copy or, for a process whose node was lost, from the copy its buddy holds.

Every verdict is agreed before anything moves: each process checks its share, the results are gathered,
and all processes reject (move aside) or use a checkpoint together, so a bad file seen by one process
never leaves another waiting in a barrier.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from trainer.ckpt import buddy, holdings
from trainer.ckpt.checkpoint import Checkpointer, Restored, SaveFailed, Verdict, agreed
from trainer.ckpt.holdings import Candidate, Copy, Holdings, Source
from trainer.config import CheckpointConfig
from trainer.parallel.distributed import allgather_json
from trainer.store import bucket, manifest
from trainer.store import ckpt_files as checkpoint_files
from trainer.store.ckpt_files import BUDDY, DURABLE, LOCAL, META, META_FILE, STATE, Meta
from trainer.store.event_names import CHECKPOINT_FAILED, CHECKPOINT_REJECTED, CHECKPOINT_RESEALED


def saved_meta(run_dir: Path, cfg: CheckpointConfig) -> Meta | None:
    """The metadata item of the newest checkpoint (either tier) whose metadata reads: what a resume is
    checked against before anything is written, and what the restore of that step uses (`Tiers(saved=)`).
    A torn one is skipped here; the restore rejects it. Read as this process alone: processes may find their
    newest metadata in different tiers (a replaced node has no local one)."""
    durable = checkpoint_files.durable_dir(run_dir, cfg.durable_dir)
    if url := checkpoint_files.durable_url(run_dir, cfg.durable_dir):
        return _bucket_meta(url, durable)
    dirs = [durable]
    if cfg.local_dir:
        dirs.append(checkpoint_files.local_dir(cfg.local_dir, run_dir, jax.process_index(), buddy.node_name()))
    found = [(s, d) for d in dirs for s in checkpoint_files.committed_steps(d)]
    for step, d in sorted(found, key=lambda f: f[0], reverse=True):  # at one step the durable one first
        try:
            return checkpoint_files.read_meta(d / str(step))
        except Exception:  # torn or corrupt: an older one answers the same question
            continue
    return None


def _bucket_meta(url: str, staging: Path) -> Meta | None:
    """saved_meta for a bucket (no local tier beside it is read here: the bucket is the run's record)."""
    b = bucket.Bucket(url)
    for step in sorted((s for s, ok in b.steps().items() if ok), reverse=True):
        try:
            return Meta(staging / str(step), json.loads(b.read(f"{step}/{META}/{META_FILE}")))
        except Exception:  # torn or corrupt (the restore rejects it): the one before answers
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
        saved: Meta | None = None,
    ):
        """`saved`: the newest metadata, read at start-up (saved_meta): the restore does not read it again."""
        self.cfg, self.log = cfg, log
        self.run_dir = Path(run_dir)
        self.durable = Checkpointer(
            checkpoint_files.durable_dir(self.run_dir, cfg.durable_dir),
            cfg,
            pinned=pinned,
            commit_delay=commit_delay,
            remote=checkpoint_files.durable_url(self.run_dir, cfg.durable_dir),
        )
        self.local: Checkpointer | None = None
        self.pairing: buddy.Pairing | None = None  # who holds whose local copy; None: no copies (one node)
        self._readers: dict[str, Checkpointer] = {}  # local folders on this node, by name, read-only
        self._metas: dict[Path, Meta] = {} if saved is None else {saved.step_dir: saved}  # by step dir, read once
        self.node = buddy.node_name()
        if cfg.local_dir:
            self.local = Checkpointer(
                checkpoint_files.local_dir(cfg.local_dir, run_dir, jax.process_index(), self.node), cfg, tier=LOCAL
            )
            self._neighbours = {jax.process_index()}  # the processes on this node (they share its local root)
            if jax.process_count() > 1:
                nodes = buddy.nodes_of_processes()
                self.pairing = buddy.pair(nodes)
                self._neighbours = {i for i, n in enumerate(nodes) if n == nodes[jax.process_index()]}
        self._stale_checked = False
        self._saved_local: list[int] = []
        # The runbook's rewind targets, oldest first: a local checkpoint saved before the i-th rewind and past
        # its target belongs to an abandoned history (the supervisor cannot reach node-local disks to move it).
        self.rewinds = rewinds

    # --- saving ---------------------------------------------------------------------------------------
    @property
    def has_local(self) -> bool:
        """A local tier is configured and has not failed in this attempt. With copies exchanged, every process
        takes part in every local save (the transfer is a collective), even one whose own writes failed."""
        return self.local is not None or self.pairing is not None

    def save(self, step: int, state: Any, data_state: dict, meta: dict, *, tier: str) -> float | None:
        """Start an async save into one tier; blocking seconds. A durable failure raises SaveFailed; a local
        one (None) turns the local tier off for this attempt (the durable tier still protects the run).
        A local save first sends every process's shards to its buddy: the blocking seconds include it."""
        meta = dict(meta, lineage=len(self.rewinds))
        if tier == DURABLE:
            return self.durable.save(step, state, data_state, meta)
        held = None
        if self.pairing is not None:
            jax.block_until_ready(state)  # the step in flight is not the transfer's cost
            t0 = time.perf_counter()
            held = buddy.send(state, self.pairing)
            meta = dict(meta, holds=self.pairing.held, node=self.node)
        if self.local is None:
            return None
        self._drop_stale_folders()
        self._saved_local.append(step)
        try:
            blocking = self.local.save(step, state, data_state, dict(meta, process=jax.process_index()), held=held)
        except SaveFailed:
            self._local_failed()
            return None
        return blocking if held is None else time.perf_counter() - t0

    def _drop_stale_folders(self) -> None:
        """Once this attempt's first local save is sealed, the folders on this node that no process here
        writes any more (a process index that moved to another node with a restart) go: their copies are
        older than the new one, and the node-local disk is small."""
        listed = checkpoint_files.sealed_steps if self.cfg.verify else checkpoint_files.committed_steps
        if self._stale_checked or not set(self._saved_local) & set(listed(self.local.directory)):
            return
        self._stale_checked = True
        if jax.process_index() != min(self._neighbours):
            return
        for folder in checkpoint_files.local_dirs(self.cfg.local_dir, self.run_dir, self.node):
            if int(folder.name.rsplit("_", 1)[1]) not in self._neighbours:
                shutil.rmtree(folder, ignore_errors=True)
                self._readers.pop(folder.name, None)

    def fail_next_save(self, error: OSError) -> None:
        """The disk_full fault (trainer.faults.injector): the next durable save fails with `error`, as the file
        system would fail it."""
        self.durable.fail_next_save(error)

    def failure(self) -> str | None:
        """Why a durable save could not be written, or None (asked every step). A local one never ends the
        run: `drop_failed_local`."""
        return self.durable.failure

    def drop_failed_local(self) -> None:
        """A local save that failed in the background (its sealing thread saw it): an event, and the local tier
        off until restart (the durable tier still protects the run). Called every step, beside `failure`."""
        if self.local and self.local.failure:
            self._local_failed()

    def _local_failed(self) -> None:
        self.log(CHECKPOINT_FAILED, tier=LOCAL, message=self.local.failure, action="local tier off until restart")
        self.local = None

    def close(self) -> None:
        for ck in (self.local, self.durable):
            if ck:
                ck.close()

    # --- restoring ------------------------------------------------------------------------------------
    def restore_newest(self, abstract_state: Any, *, layout: dict) -> Restored | None:
        """The newest checkpoint the group can assemble and verify, across both tiers (at one step the local
        copy wins: it reads fastest). Bad copies are rejected with an event and moved aside, and the choice
        is made again (another copy of the same step may still serve)."""
        try:
            self._settle_staging()
            return self._restore_newest(abstract_state, layout)
        finally:
            self._metas.clear()  # read once per restore: a later save may write a step of the same number

    def _restore_newest(self, abstract_state: Any, layout: dict) -> Restored | None:
        while (cand := self._newest(layout)) is not None:
            step, tier = cand.step, cand.tier
            if tier == LOCAL:
                restored, verdict = self._restore_local(step, cand.plan, abstract_state)
            else:
                self._fetch(step)
                check = lambda step=step: self.durable.verify(step) if self.cfg.verify else None  # noqa: E731
                verdict = agreed(check)
                restored = None
                if verdict.ok:
                    restored, verdict = self._restore(self.durable, step, abstract_state)
            if verdict.ok:
                return restored
            self.log(CHECKPOINT_REJECTED, step=step, tier=tier, **verdict.fields())
            self._move_aside(tier, step, verdict)
        return None

    def _settle_staging(self) -> None:
        """With a bucket, before anything is restored or saved: each staged step the bucket does not hold sealed
        is settled. One sealed on disk (every process's manifest there) had its upload cut short (a process lost
        mid-upload, its node with it): it is uploaded again, every process its share of the manifests, rather
        than dropped for the older step before it. One sealed nowhere (a process died between Orbax's commit
        and its checksums) goes: the bucket is the record, and Orbax would refuse to save that step again. A
        bucket that does not answer is a storage failure, as for a download. (A step deleted from the bucket
        while its staged copy stayed sealed is uploaded again: the runbook's rewind and a rejection move the
        staged copy aside first.) One listing of the bucket, by process 0, decides for all."""
        if self.durable.bucket is None:
            return
        plan: dict[str, list[int]] = {"upload": [], "drop": []}
        if jax.process_index() == 0:
            sealed = set(self.durable.steps())
            for step in checkpoint_files.committed_steps(self.durable.directory):
                if step not in sealed:
                    plan["upload" if manifest.sealed(self.durable.step_dir(step)) else "drop"].append(step)
        plan = allgather_json(plan)[0]
        i, n = jax.process_index(), jax.process_count()
        for step in plan["upload"]:
            step_dir = self.durable.step_dir(step)

            def upload(step_dir: Path = step_dir) -> None:
                for m in range(i, len(manifest.read(step_dir)[0]), n):
                    self.durable.bucket.upload(step_dir, m)

            failed = agreed(lambda upload=upload: _unreadable(upload))
            if not failed.ok:
                self.durable.failure = (
                    f"the staged checkpoint of step {step} could not be uploaded to {self.durable.bucket.loc}: "
                    f"{failed.problem.reason}. Nothing was deleted; fix the storage, then rerun the same command."
                )
                raise SaveFailed(self.durable.failure)
            self.log(CHECKPOINT_RESEALED, step=step, tier=DURABLE)
        if i == 0:
            for step in plan["drop"]:
                shutil.rmtree(self.durable.step_dir(step), ignore_errors=True)
        if n > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("staging-settled")
        self.durable.reload()

    def _fetch(self, step: int) -> None:
        """A bucket's step into the staging directory, every process its share, then Orbax's listing re-read. A
        bucket that does not answer (after retries) is a storage failure: SaveFailed, never a verdict against
        the step (which would delete it)."""
        if self.durable.bucket is None:
            return
        failed = agreed(lambda: _unreadable(lambda: self.durable.fetch(step)))
        if not failed.ok:
            self.durable.failure = (
                f"the durable checkpoint of step {step} could not be read from {self.durable.bucket.loc}: "
                f"{failed.problem.reason}. Nothing was deleted; fix the storage, then rerun the same command to "
                "resume."
            )
            raise SaveFailed(self.durable.failure)
        self.durable.reload()

    def _newest(self, layout: dict) -> Candidate | None:
        """The newest step the group can assemble (at one step the local copy first), from every process's
        holdings, gathered."""
        mine = Holdings(tuple(self.durable.steps()), tuple(self._holdings(layout)), self.node)
        views = [Holdings.from_json(v) for v in allgather_json(mine.to_json())]
        return max(holdings.candidates(views), key=lambda c: (c.step, c.tier == LOCAL), default=None)

    def _holdings(self, layout: dict) -> list[Copy]:
        """The local copies on this node this process could restore from. Only the same mesh and process count
        (a local copy holds one process's shards) and not from a history the runbook rewound away from. A copy
        whose metadata does not read stays a candidate under its folder's process: verification rejects it
        with an event."""
        if not self.cfg.local_dir:
            return []
        out = []
        for folder in checkpoint_files.local_dirs(self.cfg.local_dir, self.run_dir, self.node):
            owner = int(folder.name.rsplit("_", 1)[1])
            reader = self._reader(folder.name)
            for step in reader.steps():
                try:
                    meta = self._meta(reader.step_dir(step))
                except Exception:
                    out.append(Copy(step, owner, folder.name, STATE))
                    continue
                stale = any(to < step for to in self.rewinds[meta.lineage :])
                if stale or meta.processes != layout["processes"] or meta.mesh != layout["mesh"]:
                    continue
                out.append(Copy(step, owner, folder.name, STATE))
                if meta.holds is not None and (reader.step_dir(step) / BUDDY).is_dir():
                    out.append(Copy(step, meta.holds, folder.name, BUDDY))
        return out

    def _meta(self, step_dir: Path) -> Meta:
        """A step's metadata, read once per restore (the newest one already at start-up: `saved`)."""
        step_dir = Path(step_dir).absolute()
        if step_dir not in self._metas:
            self._metas[step_dir] = checkpoint_files.read_meta(step_dir)
        return self._metas[step_dir]

    def _reader(self, folder: str) -> Checkpointer:
        if folder not in self._readers:
            root = checkpoint_files.local_root(self.cfg.local_dir, self.run_dir, self.node)
            self._readers[folder] = Checkpointer(root / folder, self.cfg, tier=LOCAL, read_only=True)
        return self._readers[folder]

    def _restore_local(self, step: int, plan: dict[int, Source], abstract: Any) -> tuple[Restored | None, Verdict]:
        """Every process reads what the plan gives it (its own shards, or another's onto its devices standing
        in for that process), the group agrees that every read worked, then the shards of processes that had
        none move to them over a collective permute (trainer.ckpt.buddy)."""
        me, n = jax.process_index(), len(plan)
        mine = {e.copy.folder for e in plan.values() if e.holder == me}
        # Each copy is verified by the process that will read it (a problem's file starts with its folder).
        verdict = agreed(lambda: self._verify_local(step, sorted(mine)))
        if not verdict.ok:
            return None, verdict
        # (targets' holders, the permutation that puts each holder in its target's place), round by round
        transfers = [(b, buddy.complete(b, n)) for b in buddy.rounds({t: e.holder for t, e in plan.items()})]
        got: dict[str, Any] = {}

        def read(target: int, stand_in: dict[int, int] | None) -> Any:
            e = plan[target].copy
            like = abstract if stand_in is None else buddy.abstract_as(abstract, stand_in)
            got["reading"] = e.folder
            reader = self._reader(e.folder)
            r = reader.restore(step, like, item=e.item, meta=lambda: self._meta(reader.step_dir(step)))
            got.setdefault("json", (r.data_state, str(r.meta.step_dir), r.meta.record))
            return r.state

        def load() -> None:
            if plan[me].holder == me:
                got["own"] = read(me, None)
            for i, (batch, stand_in) in enumerate(transfers):
                give = next((t for t, h in batch.items() if h == me), None)
                if give is not None:
                    got[f"give{i}"] = read(give, stand_in)

        def check() -> manifest.Problem | None:
            p = _unreadable(load)
            return p and manifest.Problem(f"{got.get('reading', '')}/", p.reason)

        verdict = agreed(check)
        if not verdict.ok:
            return None, verdict
        for i, (batch, stand_in) in enumerate(transfers):
            moved = buddy.move(got.pop(f"give{i}", None), stand_in, abstract)
            if me in batch:
                got["own"] = moved
        data_state, where, saved = next(j for j in allgather_json(got.get("json")) if j is not None)
        sources = {str(t): {"process": e.holder, "node": e.node, "copy": e.copy.item} for t, e in plan.items()}
        return Restored(step, got["own"], data_state, Meta(Path(where), saved), LOCAL, sources=sources), verdict

    def _verify_local(self, step: int, folders: list[str]) -> manifest.Problem | None:
        if not self.cfg.verify:
            return None
        for folder in folders:
            if (p := manifest.verify(self._reader(folder).step_dir(step))) is not None:
                return manifest.Problem(f"{folder}/{p.file}", p.reason)
        return None

    def _restore(self, ck: Checkpointer, step: int, abstract_state: Any) -> tuple[Restored | None, Verdict]:
        restored: list[Restored] = []
        meta = lambda: self._meta(ck.step_dir(step))
        verdict = agreed(lambda: _unreadable(lambda: restored.append(ck.restore(step, abstract_state, meta=meta))))
        return (restored[0] if verdict.ok else None), verdict

    def _move_aside(self, tier: str, step: int, verdict: Verdict) -> None:
        """Durable: process 0 moves the shared directory; local: the process that found the problem moves the
        copy it read (the other copies of the step may still serve). Then everyone waits for everyone and
        re-reads its listing."""
        stamp = int(time.time())
        if tier == LOCAL:
            if verdict.process == jax.process_index():
                reader = self._reader(verdict.problem.file.split("/", 1)[0])
                reader.move_aside(step, checkpoint_files.local_rejected_path(reader.directory, step, stamp))
        elif jax.process_index() == 0:
            aside = checkpoint_files.rejected_path(self.run_dir, step, stamp, self.cfg.durable_dir)
            self.durable.move_aside(step, aside)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"reject-{tier}-{step}")
        for ck in (self.durable, self.local, *self._readers.values()):
            if ck is not None:
                ck.reload()


def _unreadable(load: Callable[[], None]) -> manifest.Problem | None:
    """A read that failed (retrying what may be transient) as a verdict against the checkpoint."""
    try:
        manifest.retrying(load)
    except Exception as e:  # unreadable: torn, corrupt, or written by something else
        return manifest.Problem("", f"unreadable: {e!r}"[:300])
    return None
