"""#4 Data pipeline headroom: tokens/s the grain pipeline delivers on its own (the trainer's iterator,
same config, no training) vs the tokens/s the full trainer consumed in #1. Also the pipeline's rate at
the 124M GPU shape against what that model would consume at 45% MFU on one H200 (a modelled rate), on
the byte-tokenized default corpus and on prepared BPE shards (memory-mapped uint16 files).
"""

from __future__ import annotations

import json
import shutil
import sys
import time

from benchmarks import harness

TARGET = 10.0
H200_PEAK = 989e12  # dense bf16 FLOP/s, the trainer's own MFU table


def pipeline_tokens_per_s(*, batch: int, seq_len: int, seconds: float, warmup: int = 10, path: str = "") -> dict:
    """Drain the trainer's grain iterator for `seconds` after `warmup` batches (thread start-up)."""
    from trainer.config import load_config
    from trainer.train import data

    cfg = load_config(harness.TINY, [f"data.batch_size={batch}", f"model.seq_len={seq_len}", f"data.path={path}"])
    corpus = data.prepare(cfg.data)
    it = data.make_iterator(
        cfg.data, corpus=corpus, seq_len=seq_len, steps=10**7, seed=cfg.run.seed, process=0, processes=1, skips=[]
    )
    for _ in range(warmup):
        next(it)
    n, t0 = 0, time.perf_counter()
    while (dt := time.perf_counter() - t0) < seconds:
        assert next(it)["tokens"].shape == (batch, seq_len + 1)
        n += 1
    # Counted like the trainer counts them: seq_len trained tokens per row.
    return {
        "batches": n,
        "seconds": dt,
        "tokens_per_s": n * batch * seq_len / dt,
        "batch": batch,
        "seq_len": seq_len,
        "read_threads": cfg.data.read_threads,
        "prefetch": cfg.data.prefetch,
    }


def _gpu_124m_consumption() -> float:
    """Tokens/s the 124M config would eat at 45% MFU on one H200, by the trainer's FLOPs-per-token."""
    import jax
    import jax.numpy as jnp

    from trainer.config import load_config
    from trainer.model.model import GPT, flops_per_token

    m = load_config(str(harness.ROOT / "configs" / "gpt2-124m.yaml")).model
    shapes = jax.eval_shape(lambda: GPT(m).init(jax.random.key(0), jnp.zeros((1, m.seq_len), jnp.int32)))
    n_params = sum(int(x.size) for x in jax.tree.leaves(shapes))
    return 0.45 * H200_PEAK / flops_per_token(m, n_params)


def bpe_shards(work, quick: bool) -> tuple[str, dict]:
    """The default corpus (16 MB of stdlib sources) prepared once with a BPE of 8,192 tokens into `work`."""
    from trainer.corpus import prepare, shards, sources

    spec, mb = ("bpe:512", 1.0) if quick else ("bpe:8192", 16.0)
    out = work / f"prepared-{spec.replace(':', '')}-{mb:g}mb"
    if not shards.is_prepared(out):
        shutil.rmtree(out, ignore_errors=True)
        prepare.prepare(
            prepare.Plan(sources.default_corpus(mb), spec, sources.val_fraction(0.02, "v")), out, progress=""
        )
    meta = shards.read(out).meta
    return str(out), {k: meta[k] for k in ("tokenizer", "dtype", "n_tokens", "bytes_per_token")}


def measure(consumed_tokens_per_s: float, quick: bool, work) -> dict:
    seconds = 1.0 if quick else 4.0
    tiny = pipeline_tokens_per_s(batch=16, seq_len=128, seconds=seconds)
    gpu_shape = pipeline_tokens_per_s(batch=32, seq_len=1024, seconds=seconds)
    bpe_dir, bpe_meta = bpe_shards(work, quick)
    gpu_bpe = pipeline_tokens_per_s(batch=32, seq_len=1024, seconds=seconds, path=bpe_dir)
    need = _gpu_124m_consumption()
    headroom = tiny["tokens_per_s"] / consumed_tokens_per_s
    return {
        "data_headroom": headroom,
        "target": f">= {TARGET:g}",
        "met": headroom >= TARGET,
        "pipeline_tokens_per_s": tiny["tokens_per_s"],
        "trainer_tokens_per_s": consumed_tokens_per_s,
        "pipeline": tiny,
        "gpu_124m_shape": dict(
            gpu_shape, modelled_consumption_tokens_per_s=need, headroom_vs_modelled=gpu_shape["tokens_per_s"] / need
        ),
        "gpu_124m_shape_bpe": dict(
            gpu_bpe,
            prepared=bpe_meta,
            modelled_consumption_tokens_per_s=need,
            headroom_vs_modelled=gpu_bpe["tokens_per_s"] / need,
        ),
        "setup": "trainer.train.data.make_iterator with configs/tiny.yaml's data settings (grain; read threads "
        "and prefetch as recorded here), drained alone on the host; consumption = the full trainer's "
        "steady tokens/s from the step-overhead benchmark",
    }


def main(argv: list[str]) -> int:
    args = harness.cli(__doc__.splitlines()[0], argv)
    source = args.input or args.work / "step_overhead.json"
    if not source.is_file():
        print(
            f"error: needs the step-overhead result for the trainer's consumption: pass --input FILE "
            f"(the JSON of `python -m benchmarks.step_overhead --out FILE`); {source} not found",
            file=sys.stderr,
        )
        return 2
    consumed = json.loads(source.read_text())["trainer_tokens_per_s"]
    harness.emit(args, measure(consumed, args.quick, args.work))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
