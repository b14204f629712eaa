"""The prepared DIR: flat token shards per split, the tokenizer file and meta.json.

    DIR/meta.json          tokenizer, vocab_size, eos_id, dtype, n_tokens (train), n_val_tokens, shards
                           (file, split, n_tokens, sha256 each) and one fingerprint derived from them
    DIR/train-00000.bin    tokens of the training split, documents each followed by eos_id
    DIR/val-00000.bin      the validation split: whole documents held out by a fixed rule
    DIR/tokenizer.json     the Hugging Face tokenizer (bpe:N and tokenizer.json specs)

A training start reads meta.json and the shards' sizes, never their bytes: the fingerprint was derived
from the shard checksums when the DIR was written.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.config import ConfigError
from trainer.store.rundir import write_json

FORMAT = "trainer-prepared/1"
META = "meta.json"
SPLITS = ("train", "val")
SHARD_TOKENS = 1 << 27  # tokens per shard file: 256 MB at uint16


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def fingerprint(dtype: str, shards: list[dict]) -> str:
    """Identifies the data a checkpoint was trained on, from the per-shard checksums alone."""
    body = json.dumps({"dtype": dtype, "shards": [[s["split"], s["n_tokens"], s["sha256"]] for s in shards]})
    return hashlib.sha256(body.encode()).hexdigest()


class ShardWriter:
    """Appends token arrays to one split's shard files, cutting a new file every `shard_tokens` tokens
    (so the files depend on the token stream only, never on how it was produced), hashing as it writes."""

    def __init__(self, out: Path, split: str, dtype: str, shard_tokens: int = SHARD_TOKENS):
        self.out, self.split, self.dtype, self.shard_tokens = out, split, np.dtype(dtype), shard_tokens
        self.shards: list[dict] = []
        self.n_tokens = 0
        self._fh = None
        self._hash = None
        self._in_shard = 0

    def write(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype, copy=False)
        while tokens.size:
            if self._fh is None:
                name = f"{self.split}-{len(self.shards):05d}.bin"
                self._fh, self._hash, self._in_shard = open(self.out / name, "wb"), hashlib.sha256(), 0
                self.shards.append({"file": name, "split": self.split, "n_tokens": 0, "sha256": ""})
            part, tokens = tokens[: self.shard_tokens - self._in_shard], tokens[self.shard_tokens - self._in_shard :]
            data = part.tobytes()
            self._fh.write(data)
            self._hash.update(data)
            self._in_shard += part.size
            self.n_tokens += part.size
            if self._in_shard == self.shard_tokens:
                self._close_shard()

    def _close_shard(self) -> None:
        self._fh.close()
        self.shards[-1].update(n_tokens=self._in_shard, sha256=self._hash.hexdigest())
        self._fh = None

    def close(self) -> list[dict]:
        if self._fh is not None:
            self._close_shard()
        return self.shards


def write_meta(out: Path, meta: dict) -> None:
    """meta.json last, atomically: its presence means the DIR is complete."""
    shards = meta["shards"]
    meta = dict(
        meta,
        format=FORMAT,
        fingerprint=fingerprint(meta["dtype"], shards),
        n_tokens=sum(s["n_tokens"] for s in shards if s["split"] == "train"),
        n_val_tokens=sum(s["n_tokens"] for s in shards if s["split"] == "val"),
    )
    write_json(out / META, meta, durable=True)


@dataclass(frozen=True)
class Prepared:
    """A prepared DIR as the trainer reads it."""

    dir: Path
    meta: dict
    fresh: bool = False  # prepared by this process just now (a raw path's first use)

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]

    @property
    def dtype(self) -> str:
        return self.meta["dtype"]

    @property
    def n_tokens(self) -> int:
        return self.meta["n_tokens"]

    @property
    def n_val_tokens(self) -> int:
        return self.meta["n_val_tokens"]

    @property
    def source(self) -> str:
        return self.meta.get("source", str(self.dir))

    def shards(self, split: str) -> list[tuple[Path, int]]:
        return [(self.dir / s["file"], s["n_tokens"]) for s in self.meta["shards"] if s["split"] == split]


def is_prepared(path: Path) -> bool:
    """A complete prepared DIR (its meta.json, written last, names our format); a text directory that
    happens to hold some other meta.json is raw text."""
    try:
        return json.loads((path / META).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def read(path: Path) -> Prepared:
    """meta.json plus a size check of every shard (a stat each: no shard is read)."""
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path / META}: unreadable ({e}); prepare the data again") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ConfigError(f"{path / META}: not a {FORMAT} meta.json; prepare it with python -m trainer prepare")
    item = np.dtype(meta["dtype"]).itemsize
    for s in meta["shards"]:
        f = path / s["file"]
        size = f.stat().st_size if f.is_file() else -1
        if size != s["n_tokens"] * item:
            raise ConfigError(
                f"{f}: {'missing' if size < 0 else f'{size} bytes'}, meta.json says "
                f"{s['n_tokens'] * item}; the prepared data is damaged: prepare it again"
            )
    return Prepared(path, meta)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
