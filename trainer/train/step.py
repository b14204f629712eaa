"""Pure train step: loss and gradients (over k microbatches when asked), clipped AdamW update, the step's
metrics; lowered under the mesh and the logical-axis rules so the model's activation shardings hold."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainer.config import Config
from trainer.model import loss as loss_lib
from trainer.parallel import mesh as mesh_lib
from trainer.train.state import StateSpec


def _grads(spec: StateSpec, mesh: Mesh, microbatches: int, z_loss: float = 0.0):
    """(params, tokens, key) -> (mean loss, mean gradients) over the whole global batch. The loss reported is
    the cross-entropy alone; with train.z_loss the gradients are those of cross-entropy + z_loss x
    mean(logsumexp(logits)^2), which keeps the softmax normaliser near 1 (PaLM, OLMo). The LM head and the
    loss run slice by slice (trainer.model.loss): the whole logits never exist."""
    model, k, shards = spec.model, microbatches, mesh_lib.batch_shards(mesh)

    def loss_fn(params, tokens_BL1, key):
        ce, total = loss_lib.next_token_loss(
            model, params, tokens_BL1, z_loss=z_loss, deterministic=False, rngs={"dropout": key}, batch_shards=shards
        )
        return (total, ce) if z_loss else ce

    grad_fn = jax.value_and_grad(loss_fn)
    if z_loss:  # (ce, grads of the total)
        with_aux = jax.value_and_grad(loss_fn, has_aux=True)
        grad_fn = lambda *a: (lambda v, g: (v[1], g))(*with_aux(*a))  # noqa: E731
    if k == 1:
        return lambda params, tokens_BL1, key: grad_fn(params, tokens_BL1, jax.random.fold_in(key, 0))
    grad_sh = spec.shardings["params"]

    def accumulated(params, tokens_BL1, key):
        B = tokens_BL1.shape[0]
        # Microbatch i is rows i, i+k, i+2k, ...: every device holds an equal share of every microbatch.
        tokens_kbL1 = tokens_BL1.reshape(B // k, k, -1).swapaxes(0, 1)
        tokens_kbL1 = jax.lax.with_sharding_constraint(
            tokens_kbL1, NamedSharding(mesh, PartitionSpec(None, ("data", "fsdp")))
        )

        def body(acc, i_tokens):
            i, tokens_bL1 = i_tokens
            loss, g = grad_fn(params, tokens_bL1, jax.random.fold_in(key, i))  # distinct dropout per slice
            g_sum = jax.lax.with_sharding_constraint(jax.tree.map(jnp.add, acc[1], g), grad_sh)
            return (acc[0] + loss, g_sum), None

        zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, params), grad_sh)
        (loss_sum, g_sum), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), (jnp.arange(k), tokens_kbL1))
        return loss_sum / k, jax.tree.map(lambda g: g / k, g_sum)

    return accumulated


def make_train_step(spec: StateSpec, mesh: Mesh, *, microbatches: int = 1, z_loss: float = 0.0):
    tx = spec.tx
    grads_of = _grads(spec, mesh, microbatches, z_loss)

    def train_step(state, tokens_BL1, lr):
        """`lr`: the schedule's rate for this step (optim.lr_table[state's step]), an input rather than a constant
        of the executable: a run of another length or schedule loads this executable from the cache."""
        # The key advances every step: the checkpoint's key is the one the next step draws its dropout from,
        # so a restore that lost it (or took the seed's) would train on other masks, and resume tests see it.
        dropout_key, next_key = jax.random.split(jax.random.wrap_key_data(state["rng"]))
        loss, grads = grads_of(state["params"], tokens_BL1, dropout_key)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        hp = state["opt_state"].hyperparams
        lr = lr * hp["lr_scale"]
        # AdamW's own rate is 1 (optim._unit_rate): this is where its updates are scaled, as optax would have
        updates = jax.tree.map(lambda u: u * lr.astype(u.dtype), updates)
        metrics = {
            "loss": loss,
            "grad_norm": optax.global_norm(grads),  # before clipping: the leading spike indicator
            "update_norm": optax.global_norm(updates),
            "lr": lr,
        }
        new_state = {
            "step": state["step"] + 1,
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state,
            "rng": jax.random.key_data(next_key),
        }
        return new_state, metrics

    return jax.jit(
        train_step,
        in_shardings=(spec.shardings, mesh_lib.batch_sharding(mesh), mesh_lib.replicated(mesh)),
        out_shardings=(spec.shardings, mesh_lib.replicated(mesh)),
        donate_argnums=0,
    )


def lower_train_step(spec: StateSpec, mesh: Mesh, cfg: Config, *, microbatches: int) -> jax.stages.Lowered:
    """The train step traced for the config's global batch, under the mesh and the logical-axis rules."""
    step_fn = make_train_step(spec, mesh, microbatches=microbatches, z_loss=cfg.train.z_loss)
    tokens = jax.ShapeDtypeStruct(
        (cfg.data.batch_size, cfg.model.seq_len + 1), np.int32, sharding=mesh_lib.batch_sharding(mesh)
    )
    lr = jax.ShapeDtypeStruct((), np.float32, sharding=mesh_lib.replicated(mesh))
    with mesh_lib.active(mesh, cfg.model):
        return step_fn.lower(spec.abstract, tokens, lr)
