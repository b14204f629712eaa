"""The optax chain: global-norm clipping, then AdamW on a warmup + cosine schedule, decaying the weight
matrices that multiply activations (which ones: read off the params' logical axes, DECAY_AXIS).

LR scale, clip norm and b2 are injected hyperparameters: they live in the optimizer state, so the
loss-spike runbook can soften them on resume without a new compile, and they are checkpointed.

The schedule is not in the compiled step either: optax's schedule is evaluated once at start-up for every
step (lr_table) and the step takes its step's value as an input (trainer.train.step), the optimizer's own
learning rate being 1. A resume that extends train.steps or changes the LR, warmup or floor then loads the
step it compiled before from the compilation cache instead of compiling it again (minutes for a large model
on GPUs); so do the test suite's runs of different lengths.
"""

from __future__ import annotations

import jax
import numpy as np
import optax

from trainer.config import ModelConfig, OptimConfig
from trainer.model.model import GPT, param_axes

# Weight decay goes to the matrices that multiply activations: the attention and MLP kernels and the token
# embedding, which is also the LM head when tied (untied, lm_head and wte are both decayed, as GPT-2-style
# recipes do). Each of them reads or writes the residual stream, so its logical axes name "embed"; norm
# scales and biases never do (a D-sized bias is named "norm"). The positional table names "embed" too but is
# added to activations, not multiplied with them: its "seq" axis leaves it out. Axes decide, not rank: under
# model.scan every param gains a leading "layers" axis, and scanned and unrolled models must decay alike.
DECAY_AXIS = "embed"
NO_DECAY_AXES = frozenset({"seq"})


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def lr_table(cfg: OptimConfig, total_steps: int) -> np.ndarray:
    """The schedule's learning rate at steps 0..total_steps (float32), evaluated once, on the default device:
    the value the train step that starts at step s takes is lr_table[s] (before the runbook's lr_scale)."""
    sched = schedule(cfg, total_steps)
    # jitted: one small executable (cached), not a dozen eager ops, each compiled anew for every run length
    return np.asarray(jax.jit(jax.vmap(sched))(np.arange(total_steps + 1, dtype=np.int32)), np.float32)


def _unit_rate(count):
    """AdamW's learning rate inside the chain: 1, as a schedule (the state keeps the count it always had); the
    step scales the updates by its input rate (trainer.train.step)."""
    return 1.0


def _decays(axes) -> bool:
    names = set(axes)
    return DECAY_AXIS in names and names.isdisjoint(NO_DECAY_AXES)


def decay_mask(model_cfg: ModelConfig, params=None):
    """True for each param that weight decay reaches (a pytree shaped like the params, unboxed). `params`:
    the model's abstract params (model.abstract_params) when the caller has them already."""
    return jax.tree.map(_decays, param_axes(GPT(model_cfg), params))


def make_optimizer(cfg: OptimConfig, model_cfg: ModelConfig, params=None) -> optax.GradientTransformation:
    # A fixed pytree, not a function of the params: the step's params are unboxed and carry no axis names.
    mask = decay_mask(model_cfg, params)

    def chain(lr_scale, clip_norm, b2):
        return optax.chain(
            optax.clip_by_global_norm(clip_norm),
            optax.adamw(
                learning_rate=_unit_rate,  # the step multiplies by lr_table[step] * lr_scale
                b1=cfg.b1,
                b2=b2,
                eps=cfg.eps,
                weight_decay=cfg.weight_decay,
                mask=mask,
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
