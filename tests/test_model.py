"""The GPT itself: causal, finite in bf16 and under every remat policy, logits shaped (B, L, V), bias
gradients the plain sum, save_dots keeping the attention output; its param tree (names, shapes, logical
axes) is the one model.py documents, with or without biases, scanned or unrolled, and both compute the
same function and get weight decay on the same matrices."""

from __future__ import annotations

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from trainer.config import ModelConfig, OptimConfig
from trainer.model.layers import add_bias
from trainer.model.model import GPT, REMAT_POLICIES, attention_flops_per_token, flops_per_token
from trainer.train.optim import make_optimizer

CFG = ModelConfig(vocab_size=384, seq_len=32, d_model=64, n_layers=2, n_heads=4)


def _init(cfg):
    model = GPT(cfg)
    # jitted: one compile instead of dispatching the init op by op (5-9 s a model on 2 cores)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((2, cfg.seq_len), jnp.int32))["params"]
    return model, params


def test_logits_are_causal():
    model, params = _init(CFG)
    tokens = jax.random.randint(jax.random.key(1), (2, CFG.seq_len), 0, 256)
    changed = tokens.at[:, 20].set((tokens[:, 20] + 1) % 256)
    apply = jax.jit(model.apply)  # one compile for both calls (op by op dispatch costs seconds on 2 cores)
    a, b = apply({"params": params}, tokens), apply({"params": params}, changed)
    assert a.shape == (2, CFG.seq_len, CFG.vocab_size)
    assert np.array_equal(a[:, :20], b[:, :20])  # the past does not see the future
    assert not np.allclose(a[:, 20:], b[:, 20:])


@pytest.mark.slow  # compiles the gradient of four model variants
def test_bf16_compute_and_remat_train_to_finite_losses():
    """bf16 compute keeps fp32 master params and gradients; the attention's own remat and the remat of GPT-2's
    fused-qkv block change no loss or gradient. (Every remat policy, gradients included, on the Llama block:
    test_llama_under_every_remat_policy_and_mqa_computes_the_same_loss_and_gradients; GPT-2 keeps the policy
    that names its fused qkv.)"""
    tokens = jax.random.randint(jax.random.key(2), (4, CFG.seq_len + 1), 0, 256)
    out = {}
    variants = {
        "fp32": CFG,
        "bf16": ModelConfig(**{**CFG.__dict__, "compute_dtype": "bfloat16"}),
        "attention_remat": ModelConfig(**{**CFG.__dict__, "attention": "xla_remat"}),
        "save_attention": ModelConfig(**{**CFG.__dict__, "remat": "save_attention"}),
    }
    _, params = _init(CFG)  # the variants share one param tree (fp32 master params): initialised once
    for name, cfg in variants.items():
        model = GPT(cfg)

        def loss_fn(p, m=model):
            logits = m.apply({"params": p}, tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)  # one compile, not op-by-op dispatch
        assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))  # fp32 master params
        out[name] = float(loss), grads
    assert all(np.isfinite(v[0]) for v in out.values())
    for name in ("attention_remat", "save_attention"):
        _same_loss_and_grads(name, out[name], out["fp32"])
    assert abs(out["bf16"][0] - out["fp32"][0]) < 0.05


def _same_loss_and_grads(name: str, got, want) -> None:
    """(loss, grads) of a remat variant against the plain model's: remat changes what the backward keeps,
    never what it computes (to fp32 rounding)."""
    assert abs(float(got[0]) - float(want[0])) < 1e-6, (name, got[0], want[0])
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_flops_per_token_counts_attention_s_causal_half_and_the_whole_beside_it():
    """The MFU's attention term is the causal half, 6 x layers x D x L a token (llm.c's and MaxText's count);
    causal=False gives the whole L x L (nanoGPT's and PaLM's), twice it. 32 more positions add 32 x D
    position lookups, which are no matmul."""
    n = 1_000_000
    longer_cfg = ModelConfig(**{**CFG.__dict__, "seq_len": 64})
    base, longer = flops_per_token(CFG, n), flops_per_token(longer_cfg, n)
    assert longer - base == 6 * CFG.n_layers * CFG.d_model * 32 - 6 * 32 * CFG.d_model
    full = flops_per_token(CFG, n, causal=False)
    assert full - base == 6 * CFG.n_layers * CFG.d_model * CFG.seq_len
    assert attention_flops_per_token(CFG, causal=False) == 2 * attention_flops_per_token(CFG)


# model.py's docstring, for CFG: D=64, H=4, K=16, F=256, V=384, L=32, N=2 (scanned).
D, H, K, F, V, L, N = 64, 4, 16, 256, 384, 32, 2
TREE = {
    "wte": ((V, D), ("vocab", "embed")),
    "wpe": ((L, D), ("seq", "embed")),
    "blocks/ln_1/scale": ((N, D), ("layers", "norm")),
    "blocks/ln_1/bias": ((N, D), ("layers", "norm")),
    "blocks/qkv/kernel": ((N, D, 3, H, K), ("layers", "embed", None, "heads", "head_dim")),
    "blocks/qkv/bias": ((N, 3, H, K), ("layers", None, "heads", "head_dim")),
    "blocks/proj/kernel": ((N, H, K, D), ("layers", "heads", "head_dim", "embed")),
    "blocks/proj/bias": ((N, D), ("layers", "norm")),
    "blocks/ln_2/scale": ((N, D), ("layers", "norm")),
    "blocks/ln_2/bias": ((N, D), ("layers", "norm")),
    "blocks/fc/kernel": ((N, D, F), ("layers", "embed", "mlp")),
    "blocks/fc/bias": ((N, F), ("layers", "mlp")),
    "blocks/out/kernel": ((N, F, D), ("layers", "mlp", "embed")),
    "blocks/out/bias": ((N, D), ("layers", "norm")),
    "ln_f/scale": ((D,), ("norm",)),
    "ln_f/bias": ((D,), ("norm",)),
}


def _flat(tree) -> dict:
    return {"/".join(k.key for k in path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("bias", [True, False])
def test_param_tree_names_shapes_and_logical_axes_are_the_documented_ones(bias):
    cfg = dataclasses.replace(CFG, bias=bias)
    boxed = jax.eval_shape(lambda: GPT(cfg).init(jax.random.key(0), jnp.zeros((1, L), jnp.int32))["params"])
    shapes = {k: v.shape for k, v in _flat(nn.meta.unbox(boxed)).items()}
    specs = {k: tuple(v) for k, v in _flat(nn.get_partition_spec(boxed)).items()}
    tree = {k: v for k, v in TREE.items() if bias or not k.endswith("/bias")}  # model.bias: false has none
    assert shapes == {k: s for k, (s, _) in tree.items()}
    assert specs == {k: a for k, (_, a) in tree.items()}


def test_scanned_and_unrolled_layers_compute_the_same_function():
    model, params = _init(CFG)
    params = nn.meta.unbox(params)
    unrolled = GPT(ModelConfig(**{**CFG.__dict__, "scan": False}))
    layer_params = {f"block_{i}": jax.tree.map(lambda x, i=i: x[i], params["blocks"]) for i in range(N)}
    as_unrolled = {**{k: v for k, v in params.items() if k != "blocks"}, **layer_params}
    shapes = jax.eval_shape(lambda: unrolled.init(jax.random.key(0), jnp.zeros((1, L), jnp.int32))["params"])
    assert jax.tree.map(lambda x: x.shape, nn.meta.unbox(shapes)) == jax.tree.map(lambda x: x.shape, as_unrolled)
    tokens = jax.random.randint(jax.random.key(3), (2, L), 0, 256)
    a = jax.jit(model.apply)({"params": params}, tokens)
    b = jax.jit(unrolled.apply)({"params": as_unrolled}, tokens)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# The matrices that multiply activations; never a norm's scale, a bias or the positional table.
DECAYED = {"wte", "blocks/qkv/kernel", "blocks/proj/kernel", "blocks/fc/kernel", "blocks/out/kernel"}


def _decay_split(cfg) -> tuple[set[str], set[str]]:
    """(decayed, kept) param paths under the real optimizer, `block_{i}/` written as the scanned `blocks/`:
    with zero gradients Adam's step is zero, so only weight decay moves a param."""
    shapes = jax.eval_shape(lambda: GPT(cfg).init(jax.random.key(0), jnp.zeros((1, L), jnp.int32))["params"])
    params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), nn.meta.unbox(shapes))
    tx = make_optimizer(OptimConfig(), cfg)  # the step scales by the schedule: here the rate is 1
    updates, _ = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    decayed, kept = set(), set()
    for k, u in _flat(updates).items():
        (decayed if np.any(u != 0) else kept).add(re.sub(r"^block_\d+/", "blocks/", k))
    return decayed, kept


@pytest.mark.parametrize("scan, tie", [(True, True), (False, True), (True, False)])
def test_weight_decay_reaches_the_same_matrices_scanned_or_unrolled(scan, tie):
    decayed, kept = _decay_split(dataclasses.replace(CFG, scan=scan, tie_embeddings=tie))
    assert decayed == (DECAYED if tie else DECAYED | {"lm_head"}), sorted(decayed)
    assert not decayed & kept  # unrolled: every layer alike


def test_bias_gradient_is_the_sum_over_broadcast_axes_in_fp32():
    # add_bias replaces the add's reduce with a matmul against ones: its gradient must stay the plain sum.
    y = jax.random.normal(jax.random.key(3), (3, 5, 2, 4))
    bias = jax.random.normal(jax.random.key(4), (2, 4))
    w = jax.random.normal(jax.random.key(5), y.shape)  # a non-uniform cotangent
    ours = jax.grad(lambda y, b: (add_bias(y, b) * w).sum(), argnums=(0, 1))(y, bias)
    plain = jax.grad(lambda y, b: ((y + b) * w).sum(), argnums=(0, 1))(y, bias)
    np.testing.assert_allclose(ours[0], plain[0], rtol=1e-6)
    np.testing.assert_allclose(ours[1], plain[1], rtol=1e-5)
    # bf16 activations: the bias gradient comes back in the param's fp32, accumulated in fp32
    g_b = jax.grad(lambda b: (add_bias(y.astype(jnp.bfloat16), b).astype(jnp.float32) * w).sum())(bias)
    assert g_b.dtype == jnp.float32
    np.testing.assert_allclose(g_b, plain[1], rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(
    jax.__version_info__ < (0, 10, 2),
    reason="jax < 0.10.2's print_saved_residuals names remat residuals by the reduce_precision it inserts",
)
def test_save_dots_keeps_the_attention_output_and_recomputes_the_scores(capsys):
    # A fused attention kernel is no dot: without attn_out saved, save_dots would run its forward again.
    cfg = dataclasses.replace(CFG, remat="save_dots", scan=False)
    model, params = _init(cfg)
    tokens = jnp.zeros((2, cfg.seq_len), jnp.int32)
    jax.ad_checkpoint.print_saved_residuals(lambda p: model.apply({"params": p}, tokens).sum(), params)
    saved = capsys.readouterr().out
    assert saved.count("named 'attn_out'") == cfg.n_layers
    # the scores are recomputed: no [B, H, rows, keys] block of them is kept (q, k, v are [B, L, H, K])
    assert not re.search(rf"\[2,{cfg.n_heads},\d+,\d+\]", saved), saved


# --- the Llama family -------------------------------------------------------------------------------------

LLAMA = ModelConfig(
    arch="llama",
    vocab_size=384,
    seq_len=32,
    d_model=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    position="rope",
    norm="rmsnorm",
    mlp="swiglu",
    bias=False,
    tie_embeddings=False,
    qk_norm=True,
)
G, FS = 2, 192  # K/V heads; SwiGLU width: 8/3 x 64 rounded up to 64
LLAMA_TREE = {
    "wte": ((V, D), ("vocab", "embed")),
    "blocks/ln_1/scale": ((N, D), ("layers", "norm")),
    "blocks/q/kernel": ((N, D, H, K), ("layers", "embed", "heads", "head_dim")),
    "blocks/kv/kernel": ((N, D, 2, G, K), ("layers", "embed", None, "kv_heads", "head_dim")),
    "blocks/q_norm/scale": ((N, K), ("layers", "norm")),
    "blocks/k_norm/scale": ((N, K), ("layers", "norm")),
    "blocks/proj/kernel": ((N, H, K, D), ("layers", "heads", "head_dim", "embed")),
    "blocks/ln_2/scale": ((N, D), ("layers", "norm")),
    "blocks/gate_up/kernel": ((N, D, 2, FS), ("layers", "embed", None, "mlp")),
    "blocks/out/kernel": ((N, FS, D), ("layers", "mlp", "embed")),
    "ln_f/scale": ((D,), ("norm",)),
    "lm_head": ((D, V), ("embed", "vocab")),
}


def test_llama_param_tree_is_the_documented_one_and_mha_fuses_qkv():
    boxed = jax.eval_shape(lambda: GPT(LLAMA).init(jax.random.key(0), jnp.zeros((1, L), jnp.int32))["params"])
    shapes = {k: v.shape for k, v in _flat(nn.meta.unbox(boxed)).items()}
    specs = {k: tuple(v) for k, v in _flat(nn.get_partition_spec(boxed)).items()}
    assert shapes == {k: s for k, (s, _) in LLAMA_TREE.items()}
    assert specs == {k: a for k, (_, a) in LLAMA_TREE.items()}
    mha = dataclasses.replace(LLAMA, n_kv_heads=0, qk_norm=False)
    names = _flat(nn.meta.unbox(jax.eval_shape(lambda: GPT(mha).init(jax.random.key(0), jnp.zeros((1, L), jnp.int32)))))
    assert "params/blocks/qkv/kernel" in names and "params/blocks/kv/kernel" not in names


def test_llama_is_causal_and_rotary_scores_depend_on_relative_position_only():
    """The rotation is the only position signal: position 0 is unrotated, and a rotated q . k depends on the
    distance between the two positions, not where the pair sits."""
    from trainer.model.model import rotary

    model, params = _init(LLAMA)
    tokens = jax.random.randint(jax.random.key(1), (2, L), 0, 256)
    changed = tokens.at[:, 20].set((tokens[:, 20] + 1) % 256)
    apply = jax.jit(model.apply)  # one compile for both calls (op by op dispatch costs seconds on 2 cores)
    a, b = apply({"params": params}, tokens), apply({"params": params}, changed)
    assert np.array_equal(a[:, :20], b[:, :20]) and not np.allclose(a[:, 20:], b[:, 20:])
    q, k = jax.random.normal(jax.random.key(4), (2, 1, 1, 1, K))
    rq, rk = (rotary(jnp.broadcast_to(x, (1, L, 1, K)), 10000.0)[0, :, 0] for x in (q, k))
    np.testing.assert_array_equal(rq[0], q[0, 0, 0])
    dots = rq @ rk.T  # [i, j]: q at position i, k at position j
    np.testing.assert_allclose(dots[5, 2], dots[25, 22], rtol=1e-5)
    np.testing.assert_allclose(dots[9, 9], dots[0, 0], rtol=1e-5)
    assert abs(float(dots[5, 2] - dots[5, 3])) > 1e-3


def test_llama_scanned_and_unrolled_compute_the_same_function():
    model, params = _init(LLAMA)
    params = nn.meta.unbox(params)
    unrolled = GPT(dataclasses.replace(LLAMA, scan=False))
    layer_params = {f"block_{i}": jax.tree.map(lambda x, i=i: x[i], params["blocks"]) for i in range(N)}
    as_unrolled = {**{k: v for k, v in params.items() if k != "blocks"}, **layer_params}
    tokens = jax.random.randint(jax.random.key(3), (2, L), 0, 256)
    a = jax.jit(model.apply)({"params": params}, tokens)
    b = jax.jit(unrolled.apply)({"params": as_unrolled}, tokens)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # compiles the gradient of five variants
def test_llama_under_every_remat_policy_and_mqa_computes_the_same_loss_and_gradients():
    """Remat changes what the backward keeps, never what it computes: loss AND gradients match the plain
    model's (to fp32 rounding); with one K/V head (MQA) the model trains to a finite loss too."""
    tokens = jax.random.randint(jax.random.key(2), (4, L + 1), 0, 256)
    _, params = _init(LLAMA)
    out = {}
    for name, cfg in {"none": LLAMA, **{p: dataclasses.replace(LLAMA, remat=p) for p in REMAT_POLICIES}}.items():

        def loss_fn(p, cfg=cfg):
            m = GPT(cfg)
            return optax.softmax_cross_entropy_with_integer_labels(
                m.apply({"params": p}, tokens[:, :-1]), tokens[:, 1:]
            ).mean()

        out[name] = jax.jit(jax.value_and_grad(loss_fn))(params)
    for p in REMAT_POLICIES:
        _same_loss_and_grads(p, out[p], out["none"])
    mqa = dataclasses.replace(LLAMA, n_kv_heads=1)
    _, p1 = _init(mqa)
    loss = jax.jit(GPT(mqa).apply)({"params": p1}, tokens[:, :-1])
    assert nn.meta.unbox(p1)["blocks"]["kv"]["kernel"].shape == (N, D, 2, 1, K) and np.isfinite(np.asarray(loss)).all()


def test_llama_flops_count_gqa_swiglu_and_no_lookups():
    """6 x (the params that enter a matmul) + 6 N D L (attention's causal half; 12 N D L for the whole L x L):
    the untied input embedding is a lookup, and there is no positional table; GQA's and SwiGLU's sizes come
    in through the params themselves."""
    matmul = N * (D * H * K + D * 2 * G * K + H * K * D + 3 * D * FS) + D * V  # q, kv, o, gate|up + down, head
    norms = N * (2 * D + 2 * K) + D
    n_params = matmul + norms + V * D  # + the input embedding
    assert flops_per_token(LLAMA, n_params) == 6 * (matmul + norms) + 6 * N * D * L
    assert flops_per_token(LLAMA, n_params, causal=False) == 6 * (matmul + norms) + 12 * N * D * L
