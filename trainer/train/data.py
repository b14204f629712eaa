"""The grain pipeline that feeds steps from a prepared DIR's memory-mapped shards, and the fixed
validation windows of the held-out eval. Preparing the data is trainer.corpus (jax-free).

Data order contract: step k consumes data batch b(k) (the k-th batch index not on the skip list);
global sample g = b * global_batch + j maps to window shuffle(seed)(g) with a fresh permutation per
epoch. Process p takes rows [p*B/P, (p+1)*B/P) of every global batch. So the order is a pure
function of (seed, step, skip list) and does not depend on how many processes read it.
"""

from __future__ import annotations

import time
from pathlib import Path

import grain
import jax
import numpy as np

from trainer.config import ConfigError, DataConfig
from trainer.corpus import cache
from trainer.corpus.shards import Prepared

Corpus = Prepared


def prepare(cfg: DataConfig, *, process: int = 0, min_tokens: int = 1) -> Prepared:
    """data.path as prepared data: a prepared DIR as it is, raw text prepared once into the cache (by
    process 0 of a group; the others wait for it). Fewer than `min_tokens` training tokens (one window)
    is refused, for raw text before the cache is written when its size already says so."""
    return cache.ensure(cfg, process=process, min_tokens=min_tokens)


class TokenWindows(grain.sources.RandomAccessDataSource):
    """Non-overlapping windows of seq_len + 1 tokens (inputs and next-token targets) over one split's
    shards read as one token stream: a window may span two shards, and the windows do not depend on
    how the split was cut into files."""

    def __init__(self, shards: list[tuple[Path, int]], dtype: str, seq_len: int):
        self._shards, self._dtype, self._seq_len = [(Path(p), n) for p, n in shards], dtype, seq_len
        self._ends = np.cumsum([n for _, n in self._shards], dtype=np.int64)
        self._maps: list[np.memmap | None] = [None] * len(self._shards)  # opened on first read
        total = int(self._ends[-1]) if self._shards else 0
        self._n = max(total - 1, 0) // seq_len

    @classmethod
    def of(cls, corpus: Prepared, seq_len: int, split: str = "train") -> TokenWindows:
        return cls(corpus.shards(split), corpus.dtype, seq_len)

    def __len__(self) -> int:
        return self._n

    def _map(self, k: int) -> np.memmap:
        if self._maps[k] is None:
            self._maps[k] = np.memmap(self._shards[k][0], dtype=self._dtype, mode="r")
        return self._maps[k]

    def __getitem__(self, i: int) -> np.ndarray:
        start = (i % self._n) * self._seq_len
        stop = start + self._seq_len + 1
        k = int(np.searchsorted(self._ends, start, side="right"))
        parts = []
        while start < stop:
            first = int(self._ends[k - 1]) if k else 0
            take = min(stop, int(self._ends[k])) - start
            parts.append(self._map(k)[start - first : start - first + take])
            start, k = start + take, k + 1
        return np.concatenate(parts).astype(np.int32)

    def __reduce__(self):  # memmaps do not pickle; reopen in the reader
        return (TokenWindows, (self._shards, self._dtype, self._seq_len))


def batch_index(step: int, skips: list[int]) -> int:
    """The data batch a step consumes: the step-th batch index that is not skipped."""
    b = step
    for s in sorted(set(skips)):
        if s <= b:
            b += 1
        else:
            break
    return b


class StepPlan(grain.sources.RandomAccessDataSource):
    """Element k = the global sample ids this process reads at step k."""

    def __init__(self, *, steps: int, global_batch: int, process: int, processes: int, skips: list[int]):
        self._steps, self._skips = steps, sorted(set(skips))
        per = global_batch // processes
        self._rows = np.arange(process * per, (process + 1) * per, dtype=np.int64)
        self._global_batch = global_batch

    def __len__(self) -> int:
        return self._steps

    def __getitem__(self, k: int) -> np.ndarray:
        return batch_index(k, self._skips) * self._global_batch + self._rows


def make_iterator(
    cfg: DataConfig,
    *,
    corpus: Prepared,
    seq_len: int,
    steps: int,
    seed: int,
    process: int,
    processes: int,
    skips: list[int],
):
    """A checkpointable grain iterator over this process's slice of each step's global batch."""
    if cfg.batch_size % processes:
        raise ConfigError(f"data.batch_size ({cfg.batch_size}) must divide evenly over {processes} processes")
    windows = TokenWindows.of(corpus, seq_len)
    if len(windows) < 1:
        raise ConfigError(f"corpus {corpus.source} is shorter than one window of {seq_len + 1} tokens")
    # Sample g reads window order[g] (a fresh permutation per epoch); elements carry it for the data audit.
    order = grain.MapDataset.range(len(windows))
    if cfg.shuffle:
        order = order.shuffle(seed=seed % 2**32)
    n = len(windows)
    plan = grain.MapDataset.source(
        StepPlan(steps=steps, global_batch=cfg.batch_size, process=process, processes=processes, skips=skips)
    )

    def read(ids: np.ndarray) -> dict:
        win = np.array([order[int(g)] if cfg.shuffle else int(g) % n for g in ids], dtype=np.int64)
        return {"ids": ids, "windows": win, "tokens": np.stack([windows[int(i)] for i in win])}

    batches = plan.map(read)
    opts = grain.ReadOptions(num_threads=cfg.read_threads, prefetch_buffer_size=cfg.prefetch)
    return iter(batches.to_iter_dataset(opts))


def eval_windows(
    corpus: Prepared, *, seq_len: int, global_batch: int, batches: int, process: int, processes: int
) -> np.ndarray:
    """This process's rows of the fixed eval batches, [batches, B/P, seq_len + 1]: `batches` x `global_batch`
    validation windows spread evenly over the validation split, sharded over processes like training rows."""
    windows = TokenWindows.of(corpus, seq_len, "val")
    need = batches * global_batch
    if len(windows) < need:
        raise ConfigError(
            f"eval needs {need} validation windows of {seq_len + 1} tokens (eval.batches={batches} x "
            f"data.batch_size={global_batch}) but {corpus.source} holds out only {len(windows)} "
            f"({corpus.n_val_tokens} tokens); lower eval.batches or hold out more (data.val_fraction, "
            f"prepare --val-fraction)"
        )
    picks = (np.arange(need, dtype=np.int64) * len(windows)) // need
    per = global_batch // processes
    rows = picks.reshape(batches, global_batch)[:, process * per : (process + 1) * per]
    return np.stack([np.stack([windows[int(i)] for i in row]) for row in rows])


class Feed:
    """This process's rows of each step's batch, as a global array laid out by `sharding`; the audit
    (trainer.observe.audit, or None) records what was read."""

    def __init__(self, it, audit, sharding: jax.sharding.Sharding):
        self.it, self.audit, self.sharding = it, audit, sharding

    def next(self, step: int):
        """(the batch of `step`, seconds waited for it)."""
        t0 = time.perf_counter()
        local = next(self.it)
        batch = jax.make_array_from_process_local_data(self.sharding, local["tokens"])
        data_wait = time.perf_counter() - t0
        if self.audit:
            self.audit.record(step, local)
        return batch, data_wait
