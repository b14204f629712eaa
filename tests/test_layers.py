"""trainer.model.layers: the forward of each hand-differentiated block is the one it replaces (flax's LayerNorm
bit for bit; jax.nn.gelu evaluated in fp32; jax.nn.dot_product_attention up to the order of its sums), its
gradient is the autodiff gradient of that one, and its backward keeps what layers.py says: no fp32 copy of
the activations or of the probabilities, and no probabilities above the causal diagonal blocks."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer.config import ModelConfig
from trainer.model.layers import causal_attention, gelu, layer_norm, rms_norm
from trainer.model.model import GPT, LN_EPS

DTYPES = [jnp.float32, jnp.bfloat16]
# gradient agreement, relative to the largest entry: fp32 to rounding; bf16 to a few of its ulps
GRAD_TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
FWD_TOL = {jnp.float32: 1e-6, jnp.bfloat16: 8e-3}  # a different order of sums: fp32 rounding; one bf16 rounding


def _rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / np.abs(a).max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_is_flax_layer_norm_forward_and_gradient(dtype, bias):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4, 32, 64)) * 3 + 1, dtype)  # off-centre: the mean matters
    w = jnp.asarray(rng.normal(size=x.shape), jnp.float32)  # a non-uniform cotangent
    scale = jnp.asarray(1 + 0.1 * rng.normal(size=64), jnp.float32)
    b = jnp.asarray(0.1 * rng.normal(size=64), jnp.float32) if bias else None
    flax_ln = nn.LayerNorm(epsilon=LN_EPS, dtype=dtype, use_bias=bias)
    params = {"params": {"scale": scale, **({"bias": b} if bias else {})}}

    def ref(x, p):
        return jnp.sum(flax_ln.apply({"params": p}, x).astype(jnp.float32) * w)

    def ours(x, p):
        return jnp.sum(layer_norm(x, p["scale"], p.get("bias"), LN_EPS).astype(jnp.float32) * w)

    y_ref = jax.jit(flax_ln.apply)(params, x)
    y = jax.jit(lambda x, s, b: layer_norm(x, s, b, LN_EPS))(x, scale, b)
    assert y.dtype == dtype and np.array_equal(np.asarray(y_ref, np.float32), np.asarray(y, np.float32))
    g_ref = jax.jit(jax.grad(ref, argnums=(0, 1)))(x, params["params"])
    g = jax.jit(jax.grad(ours, argnums=(0, 1)))(x, params["params"])
    assert jax.tree.map(lambda a: a.dtype, g) == jax.tree.map(lambda a: a.dtype, g_ref)
    for a, c in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g)):
        assert _rel_err(a, c) < GRAD_TOL[dtype], (a.shape, _rel_err(a, c))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_is_the_plain_formula_forward_and_gradient(dtype):
    """Forward: Hugging Face LlamaRMSNorm's operations bit for bit; gradient: autodiff's of those."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(4, 32, 64)) * 3 + 1, dtype)
    w = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
    scale = jnp.asarray(1 + 0.1 * rng.normal(size=64), jnp.float32)

    def plain(x, s):
        xf = x.astype(jnp.float32)
        return s.astype(x.dtype) * (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + LN_EPS)).astype(x.dtype)

    y_ref, y = jax.jit(plain)(x, scale), jax.jit(lambda x, s: rms_norm(x, s, LN_EPS))(x, scale)
    assert y.dtype == dtype and np.array_equal(np.asarray(y_ref, np.float32), np.asarray(y, np.float32))
    loss = lambda f: lambda x, s: jnp.sum(f(x, s).astype(jnp.float32) * w)  # noqa: E731
    g_ref = jax.jit(jax.grad(loss(plain), argnums=(0, 1)))(x, scale)
    g = jax.jit(jax.grad(loss(lambda x, s: rms_norm(x, s, LN_EPS)), argnums=(0, 1)))(x, scale)
    for a, c in zip(g_ref, g):
        assert a.dtype == c.dtype and _rel_err(a, c) < GRAD_TOL[dtype], (a.shape, _rel_err(a, c))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_is_jax_tanh_gelu_evaluated_in_fp32_forward_and_gradient(dtype):
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(16, 512)) * 3, dtype)  # the tanh's linear, curved and flat parts
    w = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
    ref = jax.jit(lambda x: jax.nn.gelu(x.astype(jnp.float32), approximate=True))
    y = jax.jit(gelu)(x)
    assert y.dtype == dtype and np.array_equal(np.asarray(ref(x).astype(dtype), np.float32), np.asarray(y, np.float32))
    g_ref = jax.jit(jax.grad(lambda x: jnp.sum(ref(x) * w)))(x.astype(jnp.float32))
    g = jax.jit(jax.grad(lambda x: jnp.sum(gelu(x).astype(jnp.float32) * w)))(x)
    assert g.dtype == dtype and _rel_err(g_ref, g) < GRAD_TOL[dtype], _rel_err(g_ref, g)
    if dtype == jnp.bfloat16:  # closer to the fp32 values than jax.nn.gelu's bf16 forward and backward
        g_jax = jax.grad(lambda x: jnp.sum(jax.nn.gelu(x, approximate=True).astype(jnp.float32) * w))(x)
        y_err, y_jax_err = (
            float(np.mean(np.abs(np.asarray(a, np.float32) - np.asarray(ref(x)))))
            for a in (y, jax.nn.gelu(x, approximate=True))
        )
        g_err, g_jax_err = (float(np.mean(np.abs(np.asarray(a, np.float32) - np.asarray(g_ref)))) for a in (g, g_jax))
        assert y_err < y_jax_err and g_err < g_jax_err, (y_err, y_jax_err, g_err, g_jax_err)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_len", [48, 50, 49])  # 4, 2 and 1 query blocks
def test_causal_attention_is_jax_attention_forward_and_gradient(dtype, seq_len):
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(2, seq_len, 4, 24)), dtype) for _ in range(3))  # head dim 24: scale inexact
    w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

    def ref(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    o_ref, o = jax.jit(ref)(q, k, v), jax.jit(causal_attention)(q, k, v)
    # the skipped blocks add exact zeros to jax's sums: only the order of the sums differs
    assert o.dtype == dtype and _rel_err(o_ref, o) < FWD_TOL[dtype], _rel_err(o_ref, o)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * w)  # noqa: E731
    g_ref = jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2)))(q, k, v)
    g = jax.jit(jax.grad(loss(causal_attention), argnums=(0, 1, 2)))(q, k, v)
    for name, a, c in zip("qkv", g_ref, g):
        assert c.dtype == dtype and _rel_err(a, c) < GRAD_TOL[dtype], (name, _rel_err(a, c))
    # causal: the last position's key and value get gradient only from the last query
    g_last = jax.jit(jax.grad(lambda k: jnp.sum(causal_attention(q, k, v)[:, :-1].astype(jnp.float32))))(k)
    assert not np.any(np.asarray(g_last[:, -1], np.float32))


def test_the_backward_keeps_no_fp32_activations_or_probabilities(capsys):
    """In bf16, what a block keeps for its backward is in bf16, but for the LayerNorms' row statistics:
    no fp32 [B, L, D] (flax's LayerNorm kept three per norm) and no fp32 probabilities (jax's attention kept
    its softmax output besides the bf16 probabilities); and of the probabilities only the 4 query blocks'
    rows against the keys up to each block's end: 5/8 of L x L."""
    cfg = ModelConfig(
        vocab_size=384, seq_len=32, d_model=64, n_layers=2, n_heads=4, compute_dtype="bfloat16", scan=False
    )
    model = GPT(cfg)
    tokens = jnp.zeros((2, cfg.seq_len), jnp.int32)
    params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
    jax.ad_checkpoint.print_saved_residuals(lambda p: model.apply({"params": p}, tokens).sum(), params)
    saved = [line for line in capsys.readouterr().out.splitlines() if "from the argument" not in line]
    fp32 = [line for line in saved if line.startswith("f32[")]
    assert not [line for line in fp32 if line.startswith(("f32[2,32,64]", "f32[2,4,"))], fp32
    probs = sorted(line.split()[0] for line in saved if line.startswith("bf16[2,4,"))  # [B, H, rows, keys]
    assert probs == sorted([f"bf16[2,4,8,{n}]" for n in (8, 16, 24, 32)] * cfg.n_layers), probs  # once each
