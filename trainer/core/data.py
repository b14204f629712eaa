"""Corpus preparation (text -> flat byte-token file) and the grain pipeline that feeds steps.

Data order contract: step k consumes data batch b(k) (the k-th batch index not on the skip list);
global sample g = b * global_batch + j maps to window shuffle(seed)(g) with a fresh permutation per
epoch. Process p takes rows [p*B/P, (p+1)*B/P) of every global batch. So the order is a pure
function of (seed, step, skip list) and does not depend on how many processes read it.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import grain
import numpy as np

from trainer.config import ConfigError, DataConfig
from trainer.observe.rundir import atomic_write, read_json, write_json

TOKENIZER = "bytes+eos"  # ids 0..255 are bytes, 256 separates documents
EOS = 256
TOKENIZER_VOCAB = 257
TEXT_SUFFIXES = (".txt", ".md", ".py", ".jsonl")
TOKEN_DTYPE = np.uint16


@dataclass(frozen=True)
class Corpus:
    tokens_path: Path
    n_tokens: int
    fingerprint: str  # sha256 of the token bytes: identifies the data a checkpoint was trained on
    source: str


def _documents(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    if not files:
        raise ConfigError(f"data.path {path}: no {'/'.join(TEXT_SUFFIXES)} files inside")
    return files


def _default_corpus_files(cap_mb: float) -> tuple[str, list[Path]]:
    """The standard library's own .py sources: present wherever Python is, never downloaded."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in stdlib.rglob("*.py")
        if "site-packages" not in p.parts and "test" not in p.parts and "tests" not in p.parts
    )
    chosen, total = [], 0
    for p in files:
        size = p.stat().st_size
        if total + size > cap_mb * 1e6:
            break
        chosen.append(p)
        total += size
    return f"python-stdlib:{stdlib}", chosen


def _encode(files: list[Path]) -> np.ndarray:
    parts = []
    for f in files:
        parts.append(np.frombuffer(f.read_bytes(), dtype=np.uint8).astype(TOKEN_DTYPE))
        parts.append(np.array([EOS], dtype=TOKEN_DTYPE))
    return np.concatenate(parts)


def _cached_meta(cache: Path) -> dict | None:
    """The cache entry's meta.json if it and tokens.bin agree; None (tokenize again) when either is
    missing or damaged: the entry is ours, rebuilt from the text rather than trusted."""
    meta = read_json(cache / "meta.json")
    tokens = cache / "tokens.bin"
    ok = (meta is not None and isinstance(meta.get("n_tokens"), int) and isinstance(meta.get("fingerprint"), str)
          and isinstance(meta.get("source"), str) and tokens.is_file()
          and tokens.stat().st_size == meta["n_tokens"] * np.dtype(TOKEN_DTYPE).itemsize)
    return meta if ok else None


def prepare(cfg: DataConfig, *, min_tokens: int = 1) -> Corpus:
    """Tokenize the configured text once into a cache keyed by its content; reuse it afterwards. A corpus
    under `min_tokens` (one training window) is refused before anything is written."""
    if cfg.path:
        src = Path(cfg.path).expanduser()
        if not src.exists():
            raise ConfigError(f"data.path not found: {cfg.path} (point it at a text file or directory)")
        source, files = str(src.resolve()), _documents(src)
    else:
        source, files = _default_corpus_files(cfg.default_corpus_mb)
    # Key the cache by file names, sizes and mtimes so an unchanged corpus is not re-read.
    h = hashlib.sha256(TOKENIZER.encode())
    for f in files:
        st = f.stat()
        h.update(f"{f}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    cache = Path(cfg.cache_dir).expanduser() / h.hexdigest()[:16]
    meta_path = cache / "meta.json"
    if (meta := _cached_meta(cache)) is None:
        tokens = _encode(files)
        _check_length(int(tokens.size), min_tokens, source)
        cache.mkdir(parents=True, exist_ok=True)
        atomic_write(cache / "tokens.bin", tokens.tobytes())
        meta = {
            "tokenizer": TOKENIZER,
            "vocab_size": TOKENIZER_VOCAB,
            "dtype": np.dtype(TOKEN_DTYPE).name,
            "n_tokens": int(tokens.size),
            "n_files": len(files),
            "fingerprint": hashlib.sha256(tokens.tobytes()).hexdigest(),
            "source": source,
        }
        write_json(meta_path, meta)
    _check_length(meta["n_tokens"], min_tokens, source)
    return Corpus(cache / "tokens.bin", meta["n_tokens"], meta["fingerprint"], meta["source"])


def _check_length(n_tokens: int, min_tokens: int, source: str) -> None:
    if n_tokens < min_tokens:
        raise ConfigError(f"data.path {source}: {n_tokens} tokens, shorter than one training window of {min_tokens} "
                          f"(model.seq_len + 1); point data.path at more text or lower model.seq_len")


class TokenWindows(grain.sources.RandomAccessDataSource):
    """Non-overlapping windows of seq_len + 1 tokens (inputs and next-token targets)."""

    def __init__(self, tokens_path: Path, seq_len: int):
        self._path, self._seq_len = str(tokens_path), seq_len
        self._tokens = np.memmap(self._path, dtype=TOKEN_DTYPE, mode="r")
        self._n = (self._tokens.size - 1) // seq_len

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> np.ndarray:
        i = i % self._n
        start = i * self._seq_len
        return np.asarray(self._tokens[start : start + self._seq_len + 1], dtype=np.int32)

    def __reduce__(self):  # memmaps do not pickle; reopen in the reader
        return (TokenWindows, (Path(self._path), self._seq_len))


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


def make_iterator(cfg: DataConfig, *, corpus: Corpus, seq_len: int, steps: int, seed: int,
                  process: int, processes: int, skips: list[int]):
    """A checkpointable grain iterator over this process's slice of each step's global batch."""
    if cfg.batch_size % processes:
        raise ConfigError(f"data.batch_size ({cfg.batch_size}) must divide evenly over {processes} processes")
    windows = TokenWindows(corpus.tokens_path, seq_len)
    if len(windows) < 1:
        raise ConfigError(f"corpus {corpus.source} is shorter than one window of {seq_len + 1} tokens")
    # Sample g reads window order[g] (a fresh permutation per epoch); elements carry it for the data audit.
    order = grain.MapDataset.range(len(windows))
    if cfg.shuffle:
        order = order.shuffle(seed=seed % 2**32)
    n = len(windows)
    plan = grain.MapDataset.source(StepPlan(steps=steps, global_batch=cfg.batch_size, process=process,
                                            processes=processes, skips=skips))

    def read(ids: np.ndarray) -> dict:
        win = np.array([order[int(g)] if cfg.shuffle else int(g) % n for g in ids], dtype=np.int64)
        return {"ids": ids, "windows": win, "tokens": np.stack([windows[int(i)] for i in win])}

    batches = plan.map(read)
    opts = grain.ReadOptions(num_threads=cfg.read_threads, prefetch_buffer_size=cfg.prefetch)
    return iter(batches.to_iter_dataset(opts))
