"""GPT: pre-norm transformer blocks, causal attention, GELU MLP; params carry logical axis names.

Shape legend: B batch, L sequence length, D d_model, H heads, K head dim, F MLP width, V vocab.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from trainer.config import ModelConfig

P = nn.with_logical_partitioning


def _dtype(cfg: ModelConfig):
    return jnp.bfloat16 if cfg.compute_dtype == "bfloat16" else jnp.float32


def _attention_impl(cfg: ModelConfig) -> str | None:
    if cfg.attention == "auto":
        # cuDNN's fused kernel needs a GPU and half precision; XLA's path works everywhere.
        on_gpu = jax.default_backend() == "gpu"
        return "cudnn" if on_gpu and cfg.compute_dtype == "bfloat16" else "xla"
    return cfg.attention


class Block(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BLD, deterministic: bool):
        cfg, dt = self.cfg, _dtype(self.cfg)
        K = cfg.d_model // cfg.n_heads
        F = cfg.d_ff or 4 * cfg.d_model
        init = nn.initializers.normal(0.02)
        out_init = nn.initializers.normal(0.02 / (2 * cfg.n_layers) ** 0.5)  # GPT-2 residual scaling

        h_BLD = nn.LayerNorm(dtype=dt, scale_init=P(nn.initializers.ones, ("norm",)),
                             bias_init=P(nn.initializers.zeros, ("norm",)))(x_BLD)
        qkv = nn.DenseGeneral((3, cfg.n_heads, K), dtype=dt, name="qkv",
                              kernel_init=P(init, ("embed", None, "heads", "head_dim")),
                              bias_init=P(nn.initializers.zeros, (None, "heads", "head_dim")))(h_BLD)
        q_BLHK, k_BLHK, v_BLHK = (nn.with_logical_constraint(qkv[:, :, i], ("batch", "seq", "heads", "head_dim"))
                                  for i in range(3))
        o_BLHK = jax.nn.dot_product_attention(q_BLHK, k_BLHK, v_BLHK, is_causal=True,
                                              implementation=_attention_impl(cfg))
        o_BLD = nn.DenseGeneral(cfg.d_model, axis=(-2, -1), dtype=dt, name="proj",
                                kernel_init=P(out_init, ("heads", "head_dim", "embed")),
                                bias_init=P(nn.initializers.zeros, ("norm",)))(o_BLHK)
        x_BLD = x_BLD + nn.Dropout(cfg.dropout)(o_BLD, deterministic=deterministic)

        h_BLD = nn.LayerNorm(dtype=dt, scale_init=P(nn.initializers.ones, ("norm",)),
                             bias_init=P(nn.initializers.zeros, ("norm",)))(x_BLD)
        h_BLF = nn.Dense(F, dtype=dt, name="fc", kernel_init=P(init, ("embed", "mlp")),
                         bias_init=P(nn.initializers.zeros, ("mlp",)))(h_BLD)
        h_BLF = nn.gelu(h_BLF)
        h_BLD = nn.Dense(cfg.d_model, dtype=dt, name="out", kernel_init=P(out_init, ("mlp", "embed")),
                         bias_init=P(nn.initializers.zeros, ("norm",)))(h_BLF)
        x_BLD = x_BLD + nn.Dropout(cfg.dropout)(h_BLD, deterministic=deterministic)
        return nn.with_logical_constraint(x_BLD, ("batch", "seq", "act_embed"))


class GPT(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens_BL, deterministic: bool = True):
        cfg, dt = self.cfg, _dtype(self.cfg)
        init = nn.initializers.normal(0.02)
        wte = nn.Embed(cfg.vocab_size, cfg.d_model, name="wte", embedding_init=P(init, ("vocab", "embed")))
        wpe = self.param("wpe", P(nn.initializers.normal(0.01), ("seq", "embed")), (cfg.seq_len, cfg.d_model))
        x_BLD = wte(tokens_BL) + wpe[None, : tokens_BL.shape[1]]
        x_BLD = nn.Dropout(cfg.dropout)(x_BLD.astype(dt), deterministic=deterministic)
        x_BLD = nn.with_logical_constraint(x_BLD, ("batch", "seq", "act_embed"))
        block = nn.remat(Block, static_argnums=(2,)) if cfg.remat else Block
        for i in range(cfg.n_layers):
            x_BLD = block(cfg, name=f"block_{i}")(x_BLD, deterministic)
        x_BLD = nn.LayerNorm(dtype=dt, name="ln_f", scale_init=P(nn.initializers.ones, ("norm",)),
                             bias_init=P(nn.initializers.zeros, ("norm",)))(x_BLD)
        if cfg.tie_embeddings:
            logits_BLV = wte.attend(x_BLD)
        else:
            logits_BLV = nn.Dense(cfg.vocab_size, use_bias=False, dtype=dt, name="lm_head",
                                  kernel_init=P(init, ("embed", "vocab")))(x_BLD)
        return logits_BLV.astype(jnp.float32)  # the softmax runs in fp32 whatever the compute dtype


def flops_per_token(cfg: ModelConfig, n_params: int) -> float:
    """Training FLOPs per token: 6 x non-embedding params (fwd + bwd) plus attention scores."""
    n_embed = cfg.seq_len * cfg.d_model  # positional table is a lookup, not a matmul
    attn = 12 * cfg.n_layers * cfg.d_model * cfg.seq_len  # QK^T and AV, fwd + bwd, causal not halved
    return 6 * (n_params - n_embed) + attn
