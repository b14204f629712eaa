"""Training on a raw text path: it is prepared once, by the same code as `python -m trainer prepare`, into
a cache entry keyed by its content (files, sizes, mtimes) and the preparation settings.

Once per group: process 0 prepares under an exclusive lock on the entry, into a private temporary
directory that one rename turns into the entry; the other processes wait for its meta.json. No two
processes ever write the same file, and a second job on the same cache finds the entry or waits for it.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import os
import shutil
import time
import uuid
from pathlib import Path

from trainer.config import ConfigError, DataConfig
from trainer.corpus import prepare, shards, sources, tokenizer

# A waiting process gives up when no process holds the entry's lock for this long without a meta.json
# appearing: process 0 is not preparing it where this process looks (data.cache_dir not shared).
ORPHAN_WAIT_S = 60.0
QUIET_S = 10.0  # a preparation shorter than this says nothing: the run's own lines stay the first ones


def entry(cfg: DataConfig, src: sources.Source) -> Path:
    key = "\n".join(
        [
            shards.FORMAT,
            tokenizer.identity(cfg.tokenizer),
            f"val={cfg.val_fraction!r}",
            f"field={src.text_field}",
            src.stat_key(),
        ]
    )
    return Path(cfg.cache_dir).expanduser() / hashlib.sha256(key.encode()).hexdigest()[:16]


def ensure(cfg: DataConfig, *, process: int = 0, min_tokens: int = 1) -> shards.Prepared:
    """The prepared data for `cfg`: data.path itself when it is a prepared DIR, else its cache entry
    (prepared now if missing or damaged: the entry is ours, rebuilt from the text rather than trusted)."""
    path = Path(cfg.path).expanduser() if cfg.path else None
    if path is not None and shards.is_prepared(path):
        return _long_enough(shards.read(path), min_tokens)
    src = sources.open_source(cfg.path, text_field=cfg.text_field, default_corpus_mb=cfg.default_corpus_mb)
    fraction = sources.val_fraction(cfg.val_fraction, "data.val_fraction")
    dest = entry(cfg, src)
    if (prep := _usable(dest)) is None:
        if (bound := src.max_tokens()) is not None and bound < min_tokens:  # refused before anything is written
            _long_enough(shards.Prepared(dest, {"n_tokens": bound, "source": src.name}), min_tokens)
        plan = prepare.Plan(src, cfg.tokenizer, fraction, cfg.prepare_workers)
        if process == 0:
            _prepare_locked(plan, dest)
        else:
            _wait_for(dest)
        prep = dataclasses.replace(shards.read(dest), fresh=process == 0)
    return _long_enough(prep, min_tokens)


def _usable(dest: Path) -> shards.Prepared | None:
    if not shards.is_prepared(dest):
        return None
    try:
        return shards.read(dest)
    except ConfigError:  # a shard of ours torn or missing
        return None


def _long_enough(prep: shards.Prepared, min_tokens: int) -> shards.Prepared:
    if prep.n_tokens < min_tokens:
        raise ConfigError(
            f"data.path {prep.source}: {prep.n_tokens} tokens, shorter than one training window of "
            f"{min_tokens} (model.seq_len + 1); point data.path at more text or lower model.seq_len"
        )
    return prep


def _lock(dest: Path, mode: int) -> int | None:
    """flock on DEST.lock (the kernel drops it when the holder dies); None if `mode` is non-blocking and busy."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(dest.with_name(dest.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, mode)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _prepare_locked(plan: prepare.Plan, dest: Path) -> None:
    fd = _lock(dest, fcntl.LOCK_EX)
    try:
        if _usable(dest) is not None:  # another job prepared it while we waited for the lock
            return
        for orphan in dest.parent.glob(f"{dest.name}.tmp-*"):  # left by a holder that died: the lock is ours now
            shutil.rmtree(orphan, ignore_errors=True)
        tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            prepare.prepare(
                plan, tmp, progress=f"data: preparing {plan.source.name} ({plan.spec}) into {dest}", quiet_s=QUIET_S
            )
            shards.fsync_dir(tmp)
            shutil.rmtree(dest, ignore_errors=True)  # a torn entry from before meta.json existed
            os.rename(tmp, dest)
            shards.fsync_dir(dest.parent)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        os.close(fd)


def _wait_for(dest: Path, *, poll_s: float = 0.1) -> None:
    """Until process 0's meta.json appears. While the lock is held, someone is preparing: keep waiting
    (a dead process 0 takes the group down through the launcher)."""
    free_since = None
    while _usable(dest) is None:
        fd = _lock(dest, fcntl.LOCK_SH | fcntl.LOCK_NB)
        if fd is None:
            free_since = None
        else:
            os.close(fd)
            free_since = free_since or time.monotonic()
            if time.monotonic() - free_since > ORPHAN_WAIT_S:
                raise ConfigError(
                    f"data: waited {ORPHAN_WAIT_S:.0f}s for process 0 to prepare {dest}, and nobody "
                    f"is preparing it there: data.cache_dir must be shared by all processes, or "
                    f"prepare the data first (python -m trainer prepare) and set data.path to it"
                )
        time.sleep(poll_s)
