"""`python -m trainer prepare`: tokenize a corpus once into a prepared DIR, or import token files.

Tokenizing runs in parallel tokenizer processes (`--workers`; a "worker" elsewhere is a training process);
pre-tokenized flat files (nanoGPT's train.bin/val.bin) are imported as they are.
The DIR's format: trainer.corpus.shards.

The output does not depend on --workers: documents are cut into chunks by a fixed size, the chunks are
encoded anywhere, and written in input order. No jax here.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from trainer.config import ConfigError
from trainer.corpus import shards, sources, tokenizer
from trainer.corpus.tokenizer import Tok
from trainer.store import env_vars

CHUNK_BYTES = 1 << 18  # documents are sent to tokenizer processes in chunks of about this much text


@dataclass(frozen=True)
class Plan:
    """What to prepare, all inputs validated."""

    source: sources.Source
    spec: str
    val_fraction: Fraction
    processes: int = 1  # tokenizer processes (--workers, data.prepare_workers)
    shard_tokens: int = shards.SHARD_TOKENS


class _Progress:
    """One stderr line with tokens/s: redrawn in place on a terminal, every 10 s in a log. Nothing at all
    before `quiet_s` seconds (a short preparation inside a training start stays silent)."""

    def __init__(self, total_bytes: int, label: str, quiet_s: float = 0.0):
        self.total, self.label, self.quiet_s, self.tty = max(total_bytes, 1), label, quiet_s, sys.stderr.isatty()
        self.t0 = self.last = time.perf_counter()
        self.shown = False

    def update(self, n_bytes: int, n_tokens: int, *, final: bool = False) -> None:
        now = time.perf_counter()
        due = now - self.last >= (0.5 if self.tty else 10.0) and now - self.t0 >= self.quiet_s
        if not self.label or not (due or final and (self.shown or not self.quiet_s)):
            return
        self.last, self.shown = now, True
        rate = n_tokens / max(now - self.t0, 1e-9)
        line = (
            f"{self.label}: {n_bytes / self.total:4.0%} {n_bytes / 1e6:,.1f}/{self.total / 1e6:,.1f} MB  "
            f"{n_tokens:,} tokens  {rate:,.0f} tok/s"
        )
        end = "\n" if final or not self.tty else ""
        print(("\r" if self.tty else "") + line, end=end, file=sys.stderr, flush=True)


# --- encoding, in this process or in tokenizer processes -------------------------------------------------------

_ENCODE = None
_EOS = np.zeros(1, np.uint32)  # the end-of-text id, as an array of the output dtype


def _init_tokenizer_process(tok: Tok) -> None:
    global _ENCODE, _EOS
    os.environ[env_vars.TOKENIZERS_PARALLELISM] = "false"  # one thread per tokenizer process: --workers is the knob
    _ENCODE, _EOS = tok.encoder(), np.array([tok.eos_id], shards.dtype_for(tok.vocab_size))


def _encode_chunk(chunk: list[tuple[str | bytes, bool]]) -> tuple[np.ndarray, np.ndarray, int]:
    """(train tokens, val tokens, input bytes) of a chunk of (document, held out) pairs."""
    parts = {False: [], True: []}
    n_bytes = 0
    for doc, val in chunk:
        n_bytes += len(doc.encode()) if isinstance(doc, str) else len(doc)
        parts[val] += [_ENCODE(doc).astype(_EOS.dtype, copy=False), _EOS]
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, _EOS.dtype)  # noqa: E731
    return cat(parts[False]), cat(parts[True]), n_bytes


def _chunks(plan: Plan):
    chunk, size = [], 0
    for i, doc in enumerate(plan.source.documents()):
        chunk.append((doc, sources.is_val(i, plan.val_fraction)))
        size += len(doc)
        if size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _encoded(plan: Plan, tok: Tok):
    """Encoded chunks in input order; with tokenizer processes, at most 2 per process in flight (bounded memory)."""
    if plan.processes <= 1:
        _init_tokenizer_process(tok)
        yield from map(_encode_chunk, _chunks(plan))
        return
    with ProcessPoolExecutor(
        plan.processes, mp_context=get_context("spawn"), initializer=_init_tokenizer_process, initargs=(tok,)
    ) as pool:
        pending = collections.deque()
        for chunk in _chunks(plan):
            pending.append(pool.submit(_encode_chunk, chunk))
            if len(pending) >= 2 * plan.processes:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _train_docs(plan: Plan):
    return (d for i, d in enumerate(plan.source.documents()) if not sources.is_val(i, plan.val_fraction))


def build_tokenizer(plan: Plan) -> Tok:
    if n := tokenizer.bpe_size(plan.spec):  # trained on the training documents only: no peek at validation
        n_docs = sum(1 for _ in _train_docs(plan))
        return tokenizer.train_bpe(n, _train_docs(plan), n_docs=n_docs)
    return tokenizer.resolve(plan.spec)


def prepare(plan: Plan, out: Path, *, progress: str = "prepare", quiet_s: float = 0.0) -> dict:
    """Write a prepared DIR at `out` (which must not exist); returns meta.json's content plus timings.
    `progress` labels the progress line ("" = none)."""
    plan.source.check()
    t0 = time.perf_counter()
    tok = build_tokenizer(plan)
    t_tok = time.perf_counter() - t0
    out.mkdir(parents=True)
    tok.save(out)
    dtype = shards.dtype_for(tok.vocab_size)
    writers = {s: shards.ShardWriter(out, s, dtype, plan.shard_tokens) for s in shards.SPLITS}
    bar = _Progress(plan.source.n_bytes, progress, quiet_s)
    n_bytes = n_tokens = 0
    t1 = time.perf_counter()
    for train, val, b in _encoded(plan, tok):
        writers["train"].write(train)
        writers["val"].write(val)
        n_bytes, n_tokens = n_bytes + b, n_tokens + train.size + val.size
        bar.update(n_bytes, n_tokens)
    bar.update(n_bytes, n_tokens, final=True)
    meta = {
        "tokenizer": tok.name,
        "tokenizer_file": tok.file,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "dtype": dtype,
        "source": plan.source.name,
        "text_field": plan.source.text_field,
        "val_fraction": float(plan.val_fraction),
        "val_rule": sources.VAL_RULE,
        "input_bytes": n_bytes,
        "bytes_per_token": n_bytes / max(n_tokens, 1),
        "shards": writers["train"].close() + writers["val"].close(),
    }
    shards.write_meta(out, meta)
    encode_s = time.perf_counter() - t1
    return dict(shards.read(out).meta, tokenizer_s=t_tok, encode_s=encode_s, tokens_per_s=n_tokens / encode_s)


def from_tokens(
    src: Path, out: Path, *, dtype: str, vocab_size: int, eos_id: int, shard_tokens: int = shards.SHARD_TOKENS
) -> dict:
    """Import flat token files without re-tokenizing: a file (training split only) or a directory with
    train.bin and optionally val.bin (nanoGPT's layout). Token ids are checked against vocab_size."""
    files = {"train": src} if src.is_file() else {s: src / f"{s}.bin" for s in ("train", "val")}
    if not files["train"].is_file():
        raise ConfigError(f"--from-tokens {src}: no such file, nor a directory with train.bin (and val.bin)")
    item = np.dtype(dtype).itemsize
    for f in files.values():
        if f.is_file() and f.stat().st_size % item:
            raise ConfigError(f"{f}: {f.stat().st_size} bytes is not a whole number of {dtype} tokens; check --dtype")
    out.mkdir(parents=True)
    written = []
    for split, f in files.items():
        if not f.is_file():
            continue
        w = shards.ShardWriter(out, split, dtype, shard_tokens)
        tokens = np.memmap(f, dtype=dtype, mode="r") if f.stat().st_size else np.zeros(0, dtype)
        for start in range(0, tokens.size, 1 << 24):
            part = np.asarray(tokens[start : start + (1 << 24)])
            if part.size and int(part.max()) >= vocab_size:
                raise ConfigError(
                    f"{f}: token id {int(part.max())} >= --vocab-size {vocab_size}; check --dtype and --vocab-size"
                )
            w.write(part)
        written += w.close()
    shards.write_meta(
        out,
        {
            "tokenizer": tokenizer.IMPORTED,
            "tokenizer_file": None,
            "vocab_size": vocab_size,
            "eos_id": eos_id,
            "dtype": dtype,
            "source": str(src.resolve()),
            "shards": written,
        },
    )
    return shards.read(out).meta


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer prepare", description=__doc__.splitlines()[0])
    p.add_argument("--input", help="text file, directory of .txt/.md/.py/.jsonl/.parquet, .jsonl or .parquet")
    p.add_argument("--from-tokens", metavar="FILE_OR_DIR", help="import flat token files (train.bin, val.bin)")
    p.add_argument("--out", required=True, help="the prepared DIR to create (must not exist)")
    p.add_argument("--tokenizer", default="bytes", metavar="SPEC", help=f"one of {tokenizer.SPEC_FORMS}")
    p.add_argument("--text-field", default="text", help="field of .jsonl records / column of .parquet files")
    p.add_argument("--val-fraction", type=float, default=0.02, help="share of documents held out for eval")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (the output does not depend on it)")
    p.add_argument("--shard-tokens", type=int, default=shards.SHARD_TOKENS, help="tokens per shard file")
    p.add_argument("--dtype", choices=("uint16", "uint32"), help="--from-tokens: the files' token type")
    p.add_argument("--vocab-size", type=int, help="--from-tokens: the tokenizer's vocabulary size")
    p.add_argument("--eos-id", type=int, default=-1, help="--from-tokens: the end-of-text id (-1: unknown)")
    return p


def _run(args) -> dict:
    out = Path(args.out)
    if out.exists():
        raise ConfigError(f"--out {out} already exists; pick a new directory (a prepared DIR is never overwritten)")
    if args.workers < 1 or args.shard_tokens < 1:
        raise ConfigError(f"--workers ({args.workers}) and --shard-tokens ({args.shard_tokens}) must be >= 1")
    if args.from_tokens:
        if not args.dtype or not args.vocab_size or args.vocab_size < 1:
            raise ConfigError("--from-tokens needs --dtype uint16|uint32 and --vocab-size N")
        if args.dtype == "uint16" and args.vocab_size > 1 << 16:
            raise ConfigError(f"--vocab-size {args.vocab_size} does not fit uint16 tokens; use --dtype uint32")
        return from_tokens(
            Path(args.from_tokens),
            out,
            dtype=args.dtype,
            vocab_size=args.vocab_size,
            eos_id=args.eos_id,
            shard_tokens=args.shard_tokens,
        )
    if not args.input:
        raise ConfigError("pass --input PATH (text to tokenize) or --from-tokens FILE_OR_DIR")
    tokenizer.identity(args.tokenizer)  # a bad SPEC fails here, before anything is read
    plan = Plan(
        sources.open_source(args.input, text_field=args.text_field, default_corpus_mb=0, key="--input"),
        args.tokenizer,
        sources.val_fraction(args.val_fraction, "--val-fraction"),
        args.workers,
        args.shard_tokens,
    )
    return prepare(plan, out)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    existed = Path(args.out).exists()
    try:
        meta = _run(args)
    except ConfigError as e:
        if not existed:  # bad input writes nothing: drop what was started
            shutil.rmtree(args.out, ignore_errors=True)
        print(f"error: {e}", file=sys.stderr)
        return 2
    rate = f", {meta['tokens_per_s']:,.0f} tok/s with {args.workers} worker(s)" if "tokens_per_s" in meta else ""
    bpt = f", {meta['bytes_per_token']:.2f} bytes/token" if "bytes_per_token" in meta else ""
    print(
        f"prepared {args.out}: {meta['n_tokens']:,} train + {meta['n_val_tokens']:,} val tokens, "
        f"{meta['tokenizer']} (vocab {meta['vocab_size']}, {meta['dtype']}){bpt}{rate}; "
        f"fingerprint {meta['fingerprint'][:12]}"
    )
    return 0
