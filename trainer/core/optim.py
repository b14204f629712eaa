"""The optax chain: global-norm clipping, then AdamW on a warmup + cosine schedule.

LR scale, clip norm and b2 are injected hyperparameters: they live in the optimizer state, so the
loss-spike runbook can soften them on resume without a new compile, and they are checkpointed.
"""

from __future__ import annotations

import jax
import numpy as np
import optax

from trainer.config import OptimConfig


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def _decay_mask(params):
    # Weight decay on matrices only; norms, biases and the positional table's rows stay undecayed.
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    sched = schedule(cfg, total_steps)

    def chain(lr_scale, clip_norm, b2):
        return optax.chain(
            optax.clip_by_global_norm(clip_norm),
            optax.adamw(
                learning_rate=lambda count: sched(count) * lr_scale,
                b1=cfg.b1,
                b2=b2,
                eps=cfg.eps,
                weight_decay=cfg.weight_decay,
                mask=_decay_mask,
            ),
        )

    return optax.inject_hyperparams(chain)(lr_scale=1.0, clip_norm=cfg.clip_norm, b2=cfg.b2)


def set_hyperparams(state: dict, values: dict[str, float]) -> dict:
    """The train state with some injected hyperparameters replaced: same dtype and sharding, so the
    compiled step runs on unchanged (the runbook's softening, fault injection)."""
    opt = state["opt_state"]
    hp = dict(opt.hyperparams)
    for name, v in values.items():
        old = hp[name]
        # A callback per shard works for any sharding and for several processes alike.
        full = np.full(old.shape, v, old.dtype)
        hp[name] = jax.make_array_from_callback(old.shape, old.sharding, lambda idx, full=full: full[idx])
    return dict(state, opt_state=opt._replace(hyperparams=hp))
