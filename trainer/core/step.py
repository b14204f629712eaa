"""Pure train step: loss, gradients, clipped AdamW update and the step's metrics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from trainer.core.state import StateSpec


def make_train_step(spec: StateSpec, batch_sharding, metrics_sharding, lr_schedule):
    model, tx = spec.model, spec.tx

    def train_step(state, tokens_BL1):
        inputs_BL, targets_BL = tokens_BL1[:, :-1], tokens_BL1[:, 1:]
        dropout_key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])

        def loss_fn(params):
            logits_BLV = model.apply({"params": params}, inputs_BL, deterministic=False,
                                     rngs={"dropout": dropout_key})
            return optax.softmax_cross_entropy_with_integer_labels(logits_BLV, targets_BL).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        hp = state["opt_state"].hyperparams
        metrics = {
            "loss": loss,
            "grad_norm": optax.global_norm(grads),  # before clipping: the leading spike indicator
            "update_norm": optax.global_norm(updates),
            "lr": lr_schedule(state["step"]) * hp["lr_scale"],
        }
        new_state = {
            "step": state["step"] + 1,
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state,
            "rng": state["rng"],
        }
        return new_state, metrics

    return jax.jit(
        train_step,
        in_shardings=(spec.shardings, batch_sharding),
        out_shardings=(spec.shardings, metrics_sharding),
        donate_argnums=0,
    )


def all_finite(metrics) -> bool:
    return bool(jnp.isfinite(metrics["loss"]) and jnp.isfinite(metrics["grad_norm"]))
