"""`python -m trainer sample RUN_DIR --prompt TEXT`: text generated from a run's checkpoint with the run's own
model code and tokenizer, on one CPU device (the checkpoint is picked and restored as `export` does).

Decoding recomputes the whole context for every new token (no KV cache): plain and exact, fast enough for
the small models one samples on a CPU. The context is the last model.seq_len tokens, right-padded to that
length so that one compiled function serves every step (causal attention: the padding is never seen).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from trainer.ckpt import weights
from trainer.config import ConfigError
from trainer.corpus.run_tokenizer import tokenizer_of
from trainer.model.model import GPT
from trainer.observe import pick


def _next_token_fn(loaded: weights.Loaded, *, temperature: float, top_k: int):
    """A jitted (window [L], n, key) -> the token after window[:n]: the argmax at temperature 0, else a draw
    from softmax(logits / temperature), restricted to the top_k logits when top_k > 0."""
    cfg = dataclasses.replace(loaded.model, attention="xla", remat="none", dropout=0.0)  # inference on a CPU
    model = GPT(cfg)

    @jax.jit
    def next_token(params, window, n, key):
        logits = model.apply({"params": params}, window[None])[0, n - 1].astype(jnp.float32)
        if temperature == 0:
            return jnp.argmax(logits)
        logits = logits / temperature
        if top_k:
            logits = jnp.where(logits < jax.lax.top_k(logits, top_k)[0][-1], -jnp.inf, logits)
        return jax.random.categorical(key, logits)

    return lambda window, n, key: int(next_token(loaded.params, window, n, key))


def generate(
    loaded: weights.Loaded,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    eos_id: int | None = None,
) -> list[int]:
    """New token ids after the prompt: max_new_tokens of them, or fewer when end-of-text comes first."""
    seq_len = loaded.model.seq_len
    step = _next_token_fn(loaded, temperature=temperature, top_k=top_k)
    key = jax.random.key(seed)
    ids, new = list(prompt_ids), []
    for i in range(max_new_tokens):
        context = ids[-seq_len:]
        window = np.zeros(seq_len, np.int32)
        window[: len(context)] = context
        token = step(window, len(context), jax.random.fold_in(key, i))
        new.append(token)
        ids.append(token)
        if token == eos_id:
            break
    return new


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer sample",
        description=__doc__.split("\n\n")[0],
        epilog="Each new token recomputes the whole context, the last model.seq_len tokens "
        "(no KV cache): fine for the small models one samples on a CPU, slow for "
        "big ones.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run dir (or one checkpoint: RUN_DIR/checkpoints/STEP)")
    p.add_argument("--prompt", required=True, metavar="TEXT", help='text to continue ("": start from end-of-text)')
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=64,
        metavar="N",
        help="stop after this many tokens (default 64), or at end-of-text",
    )
    p.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0 = greedy (argmax); default 0.8")
    p.add_argument(
        "--top-k", type=int, default=0, metavar="K", help="draw from the k most likely tokens only (0 = all)"
    )
    p.add_argument(
        "--seed", type=int, default=0, metavar="S", help="seeds the draws (the same seed gives the same text)"
    )
    p.add_argument("--step", type=int, metavar="N", help="sample this checkpoint (default: the newest that verifies)")
    p.add_argument("--json", action="store_true", help="print one JSON object: prompt_ids, new_ids, text")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    jax.config.update("jax_platforms", "cpu")
    try:
        for flag, v, low in (
            ("--max-new-tokens", args.max_new_tokens, 1),
            ("--temperature", args.temperature, 0),
            ("--top-k", args.top_k, 0),
        ):
            if v < low:
                raise ConfigError(f"{flag} must be >= {low}, got {v}")
        picked = pick.pick(args.run_dir, args.step)
        loaded = weights.on_cpu(picked)
        run_tok = tokenizer_of(picked.run_dir, loaded.meta)
        tok = run_tok.load()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompt_ids = [int(i) for i in tok.encoder()(args.prompt)] or [tok.eos_id]
    new = generate(
        loaded,
        prompt_ids,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        eos_id=tok.eos_id,
    )
    text = tok.decoder()([i for i in new if i != tok.eos_id])
    if args.json:
        print(json.dumps({"prompt_ids": prompt_ids, "new_ids": new, "text": text}))
    else:
        how = "greedy" if args.temperature == 0 else f"temperature {args.temperature}"
        print(f"step {picked.step} of {picked.dir}, {how}, {len(new)} new tokens", file=sys.stderr)
        print(args.prompt + text)
    return 0
