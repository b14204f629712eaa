"""The GPT-style decoder in two families, one module: GPT-2's architecture (learned positions, pre-norm
LayerNorm, tanh-GELU MLP, biases, tied embeddings) and the Llama family's (rotary positions, RMSNorm, a SwiGLU
MLP, grouped-query attention, optional QK-norm, no biases, an untied LM head). `model.arch` picks a family's
parts (trainer.config.ARCH_DEFAULTS); each part is its own key, so mixtures are models too. Explicit params
named by logical axes, einsums, layers scanned and rematerialised by policy.

Shape legend: B batch, L sequence length, D d_model, H heads, G kv heads, K head dim, F MLP width, V vocab,
N layers, T the three attention inputs (q, k, v, in that order), U the SwiGLU pair (gate, up, in that order).

Param tree (fp32; `blocks` leaves carry a leading N axis, logical axis "layers", when `model.scan`;
with `model.scan: false` the same leaves sit under `block_0` ... `block_{N-1}` without it):

    wte                     [V, D]        ("vocab", "embed")      input embedding (and the LM head when tied)
    wpe                     [L, D]        ("seq", "embed")        learned positions (model.position: learned)
    blocks/ln_1/scale|bias  [N, D]        ("layers", "norm")      LayerNorm, or RMSNorm (scale only)
    blocks/qkv/kernel       [N, D, T, H, K] ("layers", "embed", None, "heads", "head_dim")   when G == H
    blocks/qkv/bias         [N, T, H, K]  ("layers", None, "heads", "head_dim")
    blocks/q/kernel         [N, D, H, K]  ("layers", "embed", "heads", "head_dim")           when G < H
    blocks/kv/kernel        [N, D, 2, G, K] ("layers", "embed", None, "kv_heads", "head_dim")
    blocks/q_norm/scale     [N, K]        ("layers", "norm")      model.qk_norm: RMSNorm of each head's q
    blocks/k_norm/scale     [N, K]        ("layers", "norm")                     and k, before the rotation
    blocks/proj/kernel      [N, H, K, D]  ("layers", "heads", "head_dim", "embed")          GPT-2 attn.c_proj
    blocks/proj/bias        [N, D]        ("layers", "norm")
    blocks/ln_2/scale|bias  [N, D]        ("layers", "norm")
    blocks/fc/kernel        [N, D, F]     ("layers", "embed", "mlp")        GELU MLP (GPT-2 mlp.c_fc)
    blocks/fc/bias          [N, F]        ("layers", "mlp")
    blocks/gate_up/kernel   [N, D, U, F]  ("layers", "embed", None, "mlp")  SwiGLU: silu(x W_gate) * (x W_up)
    blocks/out/kernel       [N, F, D]     ("layers", "mlp", "embed")        GPT-2 mlp.c_proj, Llama down_proj
    blocks/out/bias         [N, D]        ("layers", "norm")
    ln_f/scale|bias         [D]           ("norm",)
    lm_head                 [D, V]        ("embed", "vocab")      only with tie_embeddings: false

With `model.bias: false` there is no `bias` leaf at all (as in nanodo, OLMo and Llama): one add and one
gradient reduction fewer per projection and norm; the export writes GPT-2's biases as zeros, the same function.

GPT-2's c_attn weight [D, 3D] is qkv/kernel reshaped to [D, T*H*K] (row-major), its bias likewise;
c_proj's weight [D, D] is proj/kernel reshaped to [H*K, D]. Rotary positions use Hugging Face's Llama
convention (each head's dims split in halves, rotate_half), so q and k export without a permutation.
Norm epsilon: model.norm_eps (GPT-2's and Llama 2/3's 1e-5 by default).
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from trainer.config import ModelConfig
from trainer.model.layers import add_bias, causal_attention, gelu, layer_norm, rms_norm

P = nn.with_logical_partitioning
LN_EPS = 1e-5  # GPT-2's layer_norm_epsilon: model.norm_eps's default

# model.remat -> what the backward pass keeps of each block's forward (the rest is recomputed).
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,  # keep only the block's input
    # keep every projection's output and the attention output: only norms, GELU and the attention scores
    # are recomputed (without attn_out a fused attention kernel, not a dot, would run its forward again)
    "save_dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names("attn_out"),
    ),
    "save_attention": jax.checkpoint_policies.save_only_these_names("qkv", "attn_out"),  # recompute MLP + norms
}


def _dtype(cfg: ModelConfig):
    return jnp.bfloat16 if cfg.compute_dtype == "bfloat16" else jnp.float32


def attention_impl(cfg: ModelConfig, backend: str | None = None) -> str:
    """model.attention resolved for a backend: auto = cuDNN's fused kernel on a GPU in bf16, else XLA's path."""
    if cfg.attention == "auto":
        on_gpu = (backend or jax.default_backend()) == "gpu"
        return "cudnn" if on_gpu and cfg.compute_dtype == "bfloat16" else "xla"
    return cfg.attention


def kv_heads(cfg: ModelConfig) -> int:
    """G: model.n_kv_heads, 0 meaning one K/V head per query head (multi-head attention)."""
    return cfg.n_kv_heads or cfg.n_heads


def mlp_width(cfg: ModelConfig) -> int:
    """F: model.d_ff, else GPT-2's 4 D, or for SwiGLU Llama's 8/3 D (the same params as a 4 D GELU MLP)
    rounded up to a multiple of 64."""
    if cfg.d_ff:
        return cfg.d_ff
    return 4 * cfg.d_model if cfg.mlp == "gelu" else -(-8 * cfg.d_model // 3 // 64) * 64


def _attention(cfg: ModelConfig, q_BLHK, k_BLGK, v_BLGK):
    impl = attention_impl(cfg)
    if impl == "cudnn":  # takes G < H K/V heads as they are (query head h reads K/V head h // (H / G))
        return jax.nn.dot_product_attention(q_BLHK, k_BLGK, v_BLGK, is_causal=True, implementation="cudnn")
    if (rep := q_BLHK.shape[2] // k_BLGK.shape[2]) > 1:
        # XLA's path (CPU tests, inspect): K/V repeated to H heads in the same grouping (Hugging Face's repeat_kv);
        # the repeat's gradient sums each group's copies.
        k_BLHK, v_BLHK = jnp.repeat(k_BLGK, rep, axis=2), jnp.repeat(v_BLGK, rep, axis=2)
    else:
        k_BLHK, v_BLHK = k_BLGK, v_BLGK
    if impl == "xla_remat":
        # Recompute the L x L scores in the backward pass instead of keeping them: the memory profile of a
        # fused (flash) kernel without the kernel. `inspect` sizes cuDNN runs on CPU with it.
        return jax.checkpoint(causal_attention, policy=jax.checkpoint_policies.nothing_saveable)(q_BLHK, k_BLHK, v_BLHK)
    return causal_attention(q_BLHK, k_BLHK, v_BLHK)


def swiglu(gu_BLUF):
    """silu(gate) * up, from the gate|up pair [B, L, 2, F] (Llama's MLP activation)."""
    gate_BLF, up_BLF = (a.squeeze(2) for a in jnp.split(gu_BLUF, 2, axis=2))
    return jax.nn.silu(gate_BLF) * up_BLF


def rotary(x_BLHK, theta: float):
    """Rotary position embedding, Hugging Face Llama's convention: dim i of a head's first half pairs with dim
    i + K/2, rotated by position / theta^(2i / K). Angles in fp32 (as HF computes them), applied in x's dtype."""
    L, K = x_BLHK.shape[1], x_BLHK.shape[3]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, K, 2, dtype=jnp.float32) / K))
    angles_LK = jnp.tile(jnp.arange(L, dtype=jnp.float32)[:, None] * inv_freq[None], (1, 2))
    cos, sin = (f(angles_LK)[None, :, None].astype(x_BLHK.dtype) for f in (jnp.cos, jnp.sin))
    x1, x2 = jnp.split(x_BLHK, 2, axis=-1)
    return x_BLHK * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


class LayerNorm(nn.Module):
    """flax.linen.LayerNorm's params and forward (fp32 statistics, output in the compute dtype), with a
    backward that keeps fewer activations (trainer.model.layers.layer_norm)."""

    use_bias: bool
    dtype: jnp.dtype
    eps: float = LN_EPS

    @nn.compact
    def __call__(self, x):
        D = x.shape[-1]
        scale = self.param("scale", P(nn.initializers.ones, ("norm",)), (D,))
        bias = self.param("bias", P(nn.initializers.zeros, ("norm",)), (D,)) if self.use_bias else None
        return layer_norm(x.astype(self.dtype), scale, bias, self.eps)


class RMSNorm(nn.Module):
    """Llama's RMSNorm (trainer.model.layers.rms_norm): a scale, no bias, no mean subtracted."""

    dtype: jnp.dtype
    eps: float

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", P(nn.initializers.ones, ("norm",)), (x.shape[-1],))
        return rms_norm(x.astype(self.dtype), scale, self.eps)


def _norm(cfg: ModelConfig, name: str) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(_dtype(cfg), cfg.norm_eps, name=name)
    return LayerNorm(cfg.bias, _dtype(cfg), cfg.norm_eps, name=name)


class Linear(nn.Module):
    """y = einsum(act(x), kernel) + bias with explicit params: the kernel's leading `n_in` axes are
    contracted, the bias (if use_bias) has the kernel's remaining (output) axes. Multiplies in the compute
    dtype. An activation `act` is recomputed in the backward: only its input is kept."""

    equation: str  # e.g. "BLD,DTHK->BLTHK"
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    n_in: int
    std: float
    dtype: jnp.dtype
    use_bias: bool = True
    act: Callable | None = None

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", P(nn.initializers.normal(self.std), self.axes), self.shape)
        # Cast while still sharded like the param: FSDP then gathers the compute dtype (half the bytes in bf16).
        kernel = nn.with_logical_constraint(kernel.astype(self.dtype), self.axes)
        if self.act is None:
            y = jnp.einsum(self.equation, x.astype(self.dtype), kernel)
        else:
            mul = lambda x, kernel: jnp.einsum(self.equation, self.act(x).astype(self.dtype), kernel)  # noqa: E731
            y = jax.checkpoint(mul, policy=jax.checkpoint_policies.nothing_saveable)(x, kernel)
        if not self.use_bias:
            return y
        bias = self.param("bias", P(nn.initializers.zeros, self._bias_axes()), self.shape[self.n_in :])
        return add_bias(y, bias)

    def _bias_axes(self):
        out = self.axes[self.n_in :]
        return ("norm",) if out == ("embed",) else out  # a D-sized bias is tiny: replicate it like the norms


class Block(nn.Module):
    """One pre-norm transformer block; (carry, _) -> (carry, None) so that nn.scan can stack it."""

    cfg: ModelConfig
    deterministic: bool

    @nn.compact
    def __call__(self, x_BLD, _):
        cfg, dt = self.cfg, _dtype(self.cfg)
        D, H, G = cfg.d_model, cfg.n_heads, kv_heads(cfg)
        K, F = D // H, mlp_width(cfg)
        std_out = 0.02 / (2 * cfg.n_layers) ** 0.5  # GPT-2's scaling of the residual projections
        lin = lambda name, eq, shape, axes, n_in, std=0.02, act=None: Linear(  # noqa: E731
            eq, shape, axes, n_in, std, dt, cfg.bias, act, name=name
        )

        h_BLD = _norm(cfg, "ln_1")(x_BLD)
        q_BLHK, k_BLGK, v_BLGK = self._qkv(h_BLD, lin, D, H, G, K)
        if cfg.qk_norm:  # each head's q and k RMS-normalised over K, one scale per dim shared by the heads
            q_BLHK = RMSNorm(dt, cfg.norm_eps, name="q_norm")(q_BLHK)
            k_BLGK = RMSNorm(dt, cfg.norm_eps, name="k_norm")(k_BLGK)
        if cfg.position == "rope":
            q_BLHK, k_BLGK = rotary(q_BLHK, cfg.rope_theta), rotary(k_BLGK, cfg.rope_theta)
        o_BLHK = _attention(cfg, q_BLHK, k_BLGK, v_BLGK)
        o_BLHK = checkpoint_name(nn.with_logical_constraint(o_BLHK, ("batch", "seq", "heads", "head_dim")), "attn_out")
        o_BLD = lin("proj", "BLHK,HKD->BLD", (H, K, D), ("heads", "head_dim", "embed"), 2, std_out)(o_BLHK)
        x_BLD = x_BLD + nn.Dropout(cfg.dropout)(o_BLD, deterministic=self.deterministic)
        x_BLD = nn.with_logical_constraint(x_BLD, ("batch", "seq", "act_embed"))

        h_BLD = _norm(cfg, "ln_2")(x_BLD)
        if cfg.mlp == "swiglu":
            gu_BLUF = lin("gate_up", "BLD,DUF->BLUF", (D, 2, F), ("embed", None, "mlp"), 1)(h_BLD)
            gu_BLUF = nn.with_logical_constraint(gu_BLUF, ("batch", "seq", None, "mlp"))
            # out(silu(gate) * up): as with GELU, the projection recomputes the gating in the backward, so
            # only the gate|up pair is kept for it (not also silu(gate) and the product: 2 F, not 4 F a token).
            h_BLD = lin("out", "BLF,FD->BLD", (F, D), ("mlp", "embed"), 1, std_out, act=swiglu)(gu_BLUF)
        else:
            h_BLF = lin("fc", "BLD,DF->BLF", (D, F), ("embed", "mlp"), 1)(h_BLD)
            h_BLF = nn.with_logical_constraint(h_BLF, ("batch", "seq", "mlp"))
            # out(gelu(h)): the projection recomputes GELU in the backward, so only its input is kept for it.
            h_BLD = lin("out", "BLF,FD->BLD", (F, D), ("mlp", "embed"), 1, std_out, act=gelu)(h_BLF)
        x_BLD = x_BLD + nn.Dropout(cfg.dropout)(h_BLD, deterministic=self.deterministic)
        return nn.with_logical_constraint(x_BLD, ("batch", "seq", "act_embed")), None

    def _qkv(self, h_BLD, lin, D: int, H: int, G: int, K: int):
        """q [B, L, H, K], k and v [B, L, G, K]: one fused projection when G == H (GPT-2's c_attn), else q and
        the smaller K/V pair apart (their head axes shard differently)."""
        heads = ("batch", "seq", "heads", "head_dim")
        if G == H:
            qkv_BLTHK = lin("qkv", "BLD,DTHK->BLTHK", (D, 3, H, K), ("embed", None, "heads", "head_dim"), 1)(h_BLD)
            qkv_BLTHK = checkpoint_name(qkv_BLTHK, "qkv")
            # split, not three slices: the backward then concatenates dq, dk and dv into dqkv in one pass;
            # slices are transposed to three zero-padded copies of dqkv that are summed.
            return tuple(nn.with_logical_constraint(a.squeeze(2), heads) for a in jnp.split(qkv_BLTHK, 3, axis=2))
        q_BLHK = lin("q", "BLD,DHK->BLHK", (D, H, K), ("embed", "heads", "head_dim"), 1)(h_BLD)
        kv_BLTGK = lin("kv", "BLD,DTGK->BLTGK", (D, 2, G, K), ("embed", None, "kv_heads", "head_dim"), 1)(h_BLD)
        q_BLHK = nn.with_logical_constraint(checkpoint_name(q_BLHK, "qkv"), heads)
        kv_BLTGK = checkpoint_name(kv_BLTGK, "qkv")
        kv = ("batch", "seq", "kv_heads", "head_dim")
        k_BLGK, v_BLGK = (nn.with_logical_constraint(a.squeeze(2), kv) for a in jnp.split(kv_BLTGK, 2, axis=2))
        return q_BLHK, k_BLGK, v_BLGK


def _blocks(cfg: ModelConfig, x_BLD, deterministic: bool):
    block = Block
    if cfg.remat != "none":
        # Inside a scan the loop boundary already keeps XLA from merging forward and recomputation.
        block = nn.remat(Block, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan)
    if not cfg.scan:
        for i in range(cfg.n_layers):
            x_BLD, _ = block(cfg, deterministic, name=f"block_{i}")(x_BLD, None)
        return x_BLD
    stack = nn.scan(
        block,
        variable_axes={"params": 0},
        split_rngs={"params": True, "dropout": True},
        length=cfg.n_layers,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )
    x_BLD, _ = stack(cfg, deterministic, name="blocks")(x_BLD, None)
    return x_BLD


class GPT(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens_BL, deterministic: bool = True, hidden: bool = False):
        """The logits [B, L, V] (fp32); with `hidden`, what the LM head multiplies instead: the final norm's
        output [B, L, D] and the head [D, V], both in the compute dtype (trainer.model.loss takes them, so the
        loss never holds the whole logits)."""
        cfg, dt = self.cfg, _dtype(self.cfg)
        init = nn.initializers.normal(0.02)
        wte_VD = self.param("wte", P(init, ("vocab", "embed")), (cfg.vocab_size, cfg.d_model))
        # The lookup reads whole rows: gather the table's embed shards first (as FSDP does for any weight),
        # or the partitioner replicates the looked-up activations to reshard them along the batch.
        table_VD = nn.with_logical_constraint(wte_VD, ("vocab", None))
        x_BLD = jnp.take(table_VD, tokens_BL, axis=0)
        if cfg.position == "learned":
            wpe_LD = self.param("wpe", P(nn.initializers.normal(0.01), ("seq", "embed")), (cfg.seq_len, cfg.d_model))
            x_BLD = x_BLD + wpe_LD[None, : tokens_BL.shape[1]]
        x_BLD = nn.with_logical_constraint(x_BLD.astype(dt), ("batch", "seq", "act_embed"))
        x_BLD = nn.Dropout(cfg.dropout)(x_BLD, deterministic=deterministic)
        x_BLD = _blocks(cfg, x_BLD, deterministic)
        x_BLD = _norm(cfg, "ln_f")(x_BLD)
        if cfg.tie_embeddings:
            head_DV = wte_VD.T
        else:
            head_DV = self.param("lm_head", P(init, ("embed", "vocab")), (cfg.d_model, cfg.vocab_size))
        # The LM head multiplies in the compute dtype and accumulates in fp32; the softmax runs in fp32.
        # Cast while sharded like the param, as Linear does: FSDP gathers the compute dtype.
        x_BLD, head_DV = x_BLD.astype(dt), nn.with_logical_constraint(head_DV.astype(dt), ("embed", "vocab"))
        if hidden:
            return x_BLD, head_DV
        logits_BLV = jnp.einsum("BLD,DV->BLV", x_BLD, head_DV, preferred_element_type=jnp.float32)
        return nn.with_logical_constraint(logits_BLV, ("batch", "seq", "vocab"))


def abstract_params(model: GPT):
    """The params' shapes and dtypes, each boxed with its logical axis names ("layers" first under
    `model.scan`): an abstract init, no FLOPs, no memory. Traced once per process: the optimizer's decay mask
    and the state's shardings both read it (a trace of a large model costs seconds of every restart)."""
    tokens = jnp.zeros((1, model.cfg.seq_len), jnp.int32)
    return jax.eval_shape(lambda: model.init(jax.random.key(0), tokens)["params"])


def param_axes(model: GPT, params=None):
    """Each param's logical axis names (a PartitionSpec per leaf), from `abstract_params` or the given one."""
    return nn.get_partition_spec(abstract_params(model) if params is None else params)


def attention_flops_per_token(cfg: ModelConfig, *, causal: bool = True) -> float:
    """Training FLOPs per token of attention's scores: QK^T and PV (2 matmuls x 2 FLOPs per multiply-add x
    3 for forward + backward) for every query head against the keys it is counted against. `causal`, the
    convention of the MFU we log and of `inspect`'s ceilings: the causal half, L/2 keys per query on average,
    6 x layers x D x L (llm.c's and MaxText's count); otherwise all L keys, 12 x layers x D x L (nanoGPT's
    and PaLM's). K/V heads do not change it (each query head still scores its keys)."""
    return (6 if causal else 12) * cfg.n_layers * cfg.d_model * cfg.seq_len


def flops_per_token(cfg: ModelConfig, n_params: int, *, causal: bool = True) -> float:
    """Training FLOPs per token, the MFU's numerator: 6 x the params that enter a matmul (fwd + bwd), plus
    attention's scores (`attention_flops_per_token`: the causal half by default, as llm.c and MaxText count;
    `causal=False` gives the whole L x L, as nanoGPT and PaLM count, 12 x layers x D x L against 6).

    Lookups are not matmuls: the learned positions, and the input embedding when an untied LM head exists
    (tied, wte is the head). GQA's smaller K/V projections and SwiGLU's three matrices enter through the
    params themselves."""
    n_lookup = cfg.seq_len * cfg.d_model if cfg.position == "learned" else 0
    if not cfg.tie_embeddings:
        n_lookup += cfg.vocab_size * cfg.d_model
    return 6 * (n_params - n_lookup) + attention_flops_per_token(cfg, causal=causal)
