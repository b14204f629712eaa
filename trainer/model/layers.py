"""The model's building blocks whose backward pass we write ourselves (jax.custom_vjp), to choose what the
forward keeps for it and how the backward is computed. The forward computes what jax's or flax's version
computes, bit for bit, with two exceptions: GELU in bf16 is evaluated in fp32 and rounded once, and the
attention skips the score blocks the causal mask hides (the same values up to the order of the sums).

Why: what autodiff keeps is sized per layer, and under `model.scan` every kept array becomes an [N, ...]
stack that the compiled step fills in the forward loop (after zeroing it) and reads back in the backward.
Autodiff keeps, per block, three fp32 copies of the activation for each LayerNorm and both an fp32 and a
bf16 copy of the L x L attention probabilities (docs/model.md has what each change saved).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@jax.custom_vjp
def add_bias(y, bias):
    """y + bias (cast to y's dtype), whose bias gradient is a matmul of the cotangent with ones, accumulated
    in fp32: the plain add's gradient is a reduce over batch and sequence in the compute dtype, which XLA's
    CPU backend splits into slow reduce-window trees."""
    return y + bias.astype(y.dtype)


def _add_bias_fwd(y, bias):
    return add_bias(y, bias), jnp.zeros((0, *bias.shape), bias.dtype)  # empty: carries the bias' rank and dtype


def _sum_leading(g, k: int):
    """Sum over g's first k axes as a matmul with ones, accumulated in fp32 (see add_bias)."""
    ones = jnp.ones(g.shape[:k], g.dtype)
    return lax.dot_general(ones, g, ((tuple(range(k)), tuple(range(k))), ((), ())), preferred_element_type=jnp.float32)


def _add_bias_bwd(res, g):
    k = g.ndim - (res.ndim - 1)  # leading axes the bias was broadcast over
    return g, _sum_leading(g, k).astype(res.dtype)


add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)


# --- GELU ------------------------------------------------------------------------------------------------
# jax.nn.gelu in bf16 rounds after each of its ~8 elementwise ops, and autodiff's backward chains ~12 more,
# each rounded too. Here both run in fp32 (jax.nn.gelu on the input cast up, and autodiff of that) and each
# rounds once (as PyTorch's and Transformer Engine's bf16 GELU do: closer to the exact value); the backward
# keeps only the input, which is also faster. In fp32 it is jax.nn.gelu, bit for bit.


def _gelu_f32(x):
    return jax.nn.gelu(x.astype(jnp.float32), approximate=True)


@jax.custom_vjp
def gelu(x):
    """tanh-GELU (jax.nn.gelu(approximate=True)) evaluated in fp32 and rounded once to x's dtype."""
    return _gelu_fwd(x)[0]


def _gelu_fwd(x):
    return _gelu_f32(x).astype(x.dtype), x


def _gelu_bwd(x, g):
    _, vjp = jax.vjp(_gelu_f32, x)
    return (vjp(g.astype(jnp.float32))[0],)


gelu.defvjp(_gelu_fwd, _gelu_bwd)


# --- LayerNorm -----------------------------------------------------------------------------------------
# flax's LayerNorm differentiated by autodiff keeps x - mean, x^2 and the scaled product, each in fp32
# ([B, L, D] each, twice per block). This one keeps its input in the compute dtype and the two fp32 row
# statistics, and recomputes the normalised input in the backward (one elementwise pass).


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def layer_norm(x, scale, bias, eps: float):
    """flax.linen.LayerNorm over the last axis (its fast-variance statistics in fp32, output in x's dtype);
    bias may be None."""
    return _layer_norm_fwd(x, scale, bias, eps)[0]


def _layer_norm_fwd(x, scale, bias, eps):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, -1, keepdims=True)
    var = jnp.maximum(0.0, jnp.mean(lax.square(xf), -1, keepdims=True) - lax.square(mean))
    rstd = lax.rsqrt(var + eps)
    y = (x - mean) * (rstd * scale)
    if bias is not None:
        y = y + bias
    return y.astype(x.dtype), (x, mean, rstd, scale, bias)


def _layer_norm_bwd(eps, res, dy):
    x, mean, rstd, scale, bias = res
    g = dy.astype(jnp.float32)
    xhat = (x - mean) * rstd
    k = x.ndim - 1
    dscale = _sum_leading(g * xhat, k).astype(scale.dtype)
    dbias = None if bias is None else _sum_leading(g, k).astype(bias.dtype)
    dxhat = g * scale
    dx = rstd * (dxhat - jnp.mean(dxhat, -1, keepdims=True) - xhat * jnp.mean(dxhat * xhat, -1, keepdims=True))
    return dx.astype(x.dtype), dscale, dbias


layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


# --- RMSNorm ------------------------------------------------------------------------------------------
# Autodiff of the fp32 statistics would keep an fp32 copy of the activation and of the normalised product
# ([B, L, D] each, twice per block), as it did for LayerNorm. This one keeps its input in the compute dtype
# and the fp32 row statistic, and recomputes the normalised input in the backward.


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x, scale, eps: float):
    """Llama's RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) in fp32, cast to x's dtype, then scaled
    (Hugging Face's LlamaRMSNorm, operation for operation)."""
    return _rms_norm_fwd(x, scale, eps)[0]


def _rms_norm_fwd(x, scale, eps):
    xf = x.astype(jnp.float32)
    rstd = lax.rsqrt(jnp.mean(lax.square(xf), -1, keepdims=True) + eps)
    return scale.astype(x.dtype) * (xf * rstd).astype(x.dtype), (x, rstd, scale)


def _rms_norm_bwd(eps, res, dy):
    x, rstd, scale = res
    g = dy.astype(jnp.float32)
    xhat = x.astype(jnp.float32) * rstd
    dscale = _sum_leading(g * xhat, x.ndim - 1).astype(scale.dtype)
    dxhat = g * scale.astype(jnp.float32)
    dx = rstd * (dxhat - xhat * jnp.mean(dxhat * xhat, -1, keepdims=True))
    return dx.astype(x.dtype), dscale


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


# --- causal attention (XLA's path; on a GPU in bf16 cuDNN's fused kernel is used instead) -----------------
# jax.nn.dot_product_attention(implementation="xla") differentiated by autodiff keeps the fp32 softmax output
# and its compute-dtype copy, both [B, H, L, L]. This one keeps only the compute-dtype probabilities, the ones
# the forward multiplied by V. The backward's dS = P * (dP - rowsum(P * dP)) then reads P rounded to the
# compute dtype: in fp32 nothing changes; in bf16 it is one more rounding of the size that dS itself gets
# when it is cast to bf16 for the dQ and dK matmuls (both versions do that).
#
# The queries are split into QUERY_BLOCKS row blocks and block i attends only to the keys up to its last row:
# the score, softmax, P @ V and backward work above the diagonal blocks, all masked to zero, is never done
# nor kept. With 4 blocks that is 3/8 of the L x L work and residuals (a flash kernel's block skipping,
# without the kernel). The forward equals jax.nn's up to the order of the sums (the masked terms it adds
# are exact zeros).

_MASK_VALUE = np.float32(-0.7 * np.finfo(np.float32).max)  # jax.nn's: large, finite after any cast


def _scale(head_dim: int) -> np.float32:
    return np.float32(1.0 / np.sqrt(head_dim))  # as jax.nn computes it


def _scores_precision(dtype):
    # jax.nn's choice: bf16 operands, fp32 accumulation and result (jax issue #24047)
    return lax.DotAlgorithmPreset.BF16_BF16_F32 if dtype == jnp.bfloat16 else None


QUERY_BLOCKS = 4  # more blocks skip more (at most half the L x L work) but multiply small matmuls


def _query_blocks(L: int) -> int:
    return next(b for b in (QUERY_BLOCKS, 2, 1) if L % b == 0)


@jax.custom_vjp
def causal_attention(q_BLHK, k_BLHK, v_BLHK):
    """jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"): the same forward, up to
    the order of its sums."""
    return _attention_fwd(q_BLHK, k_BLHK, v_BLHK)[0]


def _attention_fwd(q_BLHK, k_BLHK, v_BLHK):
    L, K = q_BLHK.shape[1], q_BLHK.shape[3]
    n_b = _query_blocks(L)
    c = L // n_b
    o_blocks, ps = [], []
    for i in range(n_b):  # block i: queries [i c, (i + 1) c) against keys [0, (i + 1) c)
        n = (i + 1) * c
        s_BHTS = jnp.einsum(
            "BTHK,BSHK->BHTS",
            q_BLHK[:, i * c : n],
            k_BLHK[:, :n],
            precision=_scores_precision(q_BLHK.dtype),
            preferred_element_type=jnp.float32,
        )
        s_BHTS = jnp.where(jnp.tril(jnp.ones((c, n), bool), i * c), s_BHTS * _scale(K), _MASK_VALUE)
        p_BHTS = jax.nn.softmax(s_BHTS, axis=-1).astype(q_BLHK.dtype)
        o_blocks.append(jnp.einsum("BHTS,BSHK->BTHK", p_BHTS, v_BLHK[:, :n]))
        ps.append(p_BHTS)
    return jnp.concatenate(o_blocks, axis=1), (q_BLHK, k_BLHK, v_BLHK, tuple(ps))


def _attention_bwd(res, do_BLHK):
    q_BLHK, k_BLHK, v_BLHK, ps = res
    n_b, f32 = len(ps), jnp.float32
    c = q_BLHK.shape[1] // n_b
    dq_blocks, dk, dv = [], jnp.zeros(k_BLHK.shape, f32), jnp.zeros(v_BLHK.shape, f32)  # dK, dV: summed over blocks
    for i, p_BHTS in enumerate(ps):
        n = (i + 1) * c
        do_i, q_i = do_BLHK[:, i * c : n], q_BLHK[:, i * c : n]
        dv = dv.at[:, :n].add(jnp.einsum("BHTS,BTHK->BSHK", p_BHTS, do_i, preferred_element_type=f32))
        dp_BHTS = jnp.einsum("BTHK,BSHK->BHTS", do_i, v_BLHK[:, :n], preferred_element_type=f32)
        p = p_BHTS.astype(f32)
        ds_BHTS = p * (dp_BHTS - jnp.sum(dp_BHTS * p, -1, keepdims=True))  # masked entries: P = 0, so dS = 0
        ds_BHTS = (ds_BHTS * _scale(q_BLHK.shape[3])).astype(q_BLHK.dtype)
        dq_blocks.append(jnp.einsum("BHTS,BSHK->BTHK", ds_BHTS, k_BLHK[:, :n], preferred_element_type=f32))
        dk = dk.at[:, :n].add(jnp.einsum("BHTS,BTHK->BSHK", ds_BHTS, q_i, preferred_element_type=f32))
    return jnp.concatenate(dq_blocks, axis=1).astype(q_BLHK.dtype), dk.astype(k_BLHK.dtype), dv.astype(v_BLHK.dtype)


causal_attention.defvjp(_attention_fwd, _attention_bwd)
