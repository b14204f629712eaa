"""Data preparation: bytes per token and tokens/s of `prepare` (bpe:1024 on a few MB of JSONL code, with 1
and 2 worker processes: the same bytes either way), and the data set-up seconds of a training start on a
generated ~1 GB corpus: raw text prepared into the cache (cold: once), raw text again (warm: stat-keyed
cache hit) and the prepared DIR itself (meta.json and shard sizes only)."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from benchmarks import harness

WORDS = (
    "def class return import self data token shard window epoch batch step loss mesh host seed "
    "the a of to in is for with as on"
).split()


def code_jsonl(path: Path, mb: float) -> Path:
    from trainer.corpus import sources

    with open(path, "w") as fh:
        for f in sources.default_corpus(mb).files:
            fh.write(json.dumps({"text": f.read_text(errors="replace")}) + "\n")
    return path


def bpe_speed(work: Path, mb: float) -> dict:
    from trainer.corpus import prepare, sources

    src = sources.open_source(str(code_jsonl(work / "code.jsonl", mb)), text_field="text", default_corpus_mb=0)
    out: dict = {"input_mb": src.n_bytes / 1e6}
    for workers in (1, 2):
        d = work / f"bpe-w{workers}"
        shutil.rmtree(d, ignore_errors=True)
        t0 = time.perf_counter()
        m = prepare.prepare(prepare.Plan(src, "bpe:1024", sources.val_fraction(0.02, "v"), workers), d, progress="")
        out[f"workers_{workers}"] = {
            "tokens_per_s": m["tokens_per_s"],
            "encode_s": m["encode_s"],
            "bpe_training_s": m["tokenizer_s"],
            "wall_s": time.perf_counter() - t0,
        }
        out.update(bytes_per_token=m["bytes_per_token"], n_tokens=m["n_tokens"] + m["n_val_tokens"])
    same = all((work / "bpe-w1" / f.name).read_bytes() == f.read_bytes() for f in (work / "bpe-w2").iterdir())
    return dict(out, identical_output=same)


def _text_corpus(d: Path, mb: int) -> Path:
    """mb files of 1 MB of words (~1 GB for mb=1000): what a directory of text looks like to prepare."""
    import numpy as np

    if not (d / f"{mb - 1:05d}.txt").is_file():
        d.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        vocab = np.array([w.encode() + b" " for w in WORDS])
        for i in range(mb):
            (d / f"{i:05d}.txt").write_bytes(b"".join(rng.choice(vocab, 200_000))[:1_000_000])
    return d


def startup(work: Path, mb: int) -> dict:
    from trainer.config import DataConfig
    from trainer.train import data

    text = _text_corpus(work / f"text-{mb}mb", mb)
    cache = work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    timed = {}
    for name, cfg in (
        ("raw_cold_s", DataConfig(path=str(text), cache_dir=str(cache))),
        ("raw_warm_s", DataConfig(path=str(text), cache_dir=str(cache))),
    ):
        t0 = time.perf_counter()
        corpus = data.prepare(cfg)
        timed[name] = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = data.prepare(DataConfig(path=str(corpus.dir)))
    timed["prepared_dir_s"] = time.perf_counter() - t0
    assert again.fingerprint == corpus.fingerprint
    size = sum(p.stat().st_size for p in corpus.dir.iterdir())
    return dict(
        timed,
        text_bytes=sum(p.stat().st_size for p in text.iterdir()),
        prepared_bytes=size,
        shards=len(corpus.meta["shards"]),
        n_tokens=corpus.n_tokens,
    )


def main(argv: list[str]) -> int:
    args = harness.cli(__doc__.splitlines()[0], argv)
    res = {
        "bpe": bpe_speed(args.work, 1.0 if args.quick else 4.0),
        "startup": startup(args.work, 20 if args.quick else 1000),
        "command": "python -m benchmarks.data_prep" + (" --quick" if args.quick else ""),
        **harness.provenance(),
    }
    harness.emit(args, res)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
