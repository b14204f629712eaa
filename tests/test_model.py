"""The GPT itself: causal, finite in bf16 and with rematerialisation, logits shaped (B, L, V)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from trainer.config import ModelConfig
from trainer.core.model import GPT, flops_per_token

CFG = ModelConfig(vocab_size=384, seq_len=32, d_model=64, n_layers=2, n_heads=4)


def _init(cfg):
    model = GPT(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((2, cfg.seq_len), jnp.int32))["params"]
    return model, params


def test_logits_are_causal():
    model, params = _init(CFG)
    tokens = jax.random.randint(jax.random.key(1), (2, CFG.seq_len), 0, 256)
    changed = tokens.at[:, 20].set((tokens[:, 20] + 1) % 256)
    a, b = model.apply({"params": params}, tokens), model.apply({"params": params}, changed)
    assert a.shape == (2, CFG.seq_len, CFG.vocab_size)
    assert np.array_equal(a[:, :20], b[:, :20])  # the past does not see the future
    assert not np.allclose(a[:, 20:], b[:, 20:])


def test_bf16_compute_and_remat_train_to_finite_losses():
    tokens = jax.random.randint(jax.random.key(2), (4, CFG.seq_len + 1), 0, 256)
    losses = {}
    for name, cfg in {"fp32": CFG, "bf16": ModelConfig(**{**CFG.__dict__, "compute_dtype": "bfloat16"}),
                      "remat": ModelConfig(**{**CFG.__dict__, "remat": "full"})}.items():
        model, params = _init(cfg)

        def loss_fn(p, m=model):
            logits = m.apply({"params": p}, tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))  # fp32 master params
        losses[name] = float(loss)
    assert all(np.isfinite(v) for v in losses.values())
    assert abs(losses["remat"] - losses["fp32"]) < 1e-5 and abs(losses["bf16"] - losses["fp32"]) < 0.05


def test_flops_per_token_counts_attention():
    n = 1_000_000
    base = flops_per_token(CFG, n)
    longer = flops_per_token(ModelConfig(**{**CFG.__dict__, "seq_len": 64}), n)
    assert longer - base == 12 * CFG.n_layers * CFG.d_model * 32 - 6 * 32 * CFG.d_model
