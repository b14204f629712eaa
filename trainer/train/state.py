"""The train state pytree (step, params, optimizer state, PRNG key data), created already sharded."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from trainer.model.model import GPT, abstract_params
from trainer.parallel.mesh import active, rules


@dataclass(frozen=True)
class StateSpec:
    """What the worker needs to build, restore and step the state."""

    model: GPT
    tx: optax.GradientTransformation
    shardings: Any  # pytree of NamedSharding matching the state
    abstract: Any  # pytree of ShapeDtypeStruct (with shardings) for restore targets
    init: Callable[[], Any]  # jitted, returns a freshly initialised sharded state


def _init_boxed(model: GPT, tx: optax.GradientTransformation, seed: int, seq_len: int):
    key = jax.random.key(seed)
    init_key, train_key = jax.random.split(key)
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    params = model.init(init_key, tokens)["params"]
    return {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "opt_state": tx.init(params),
        # Raw key data (uint32) rather than a typed key array: plain arrays checkpoint anywhere.
        "rng": jax.random.key_data(train_key),
    }


def _abstract_boxed(params, tx: optax.GradientTransformation):
    """What _init_boxed returns, abstractly, from the model's abstract params (model.abstract_params): only the
    optimizer's init is traced, not the model again."""
    return {
        "step": jax.ShapeDtypeStruct((), jnp.int32),
        "params": params,
        "opt_state": jax.eval_shape(tx.init, params),
        "rng": jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))),
    }


def build(
    model: GPT, tx: optax.GradientTransformation, mesh: Mesh, *, seed: int, seq_len: int, params=None
) -> StateSpec:
    """`params`: the model's abstract params when the caller has traced them already (see worker.state_spec)."""
    with active(mesh, model.cfg):
        boxed = _abstract_boxed(abstract_params(model) if params is None else params, tx)
    specs = nn.get_partition_spec(boxed)
    shardings = nn.logical_to_mesh_sharding(specs, mesh, rules(mesh, model.cfg))
    unboxed = nn.meta.unbox(boxed)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), unboxed, shardings)
    init_fn = jax.jit(lambda: nn.meta.unbox(_init_boxed(model, tx, seed, seq_len)), out_shardings=shardings)

    def init():
        with active(mesh, model.cfg):  # traced on first call
            return init_fn()

    return StateSpec(model, tx, shardings, abstract, init)


def param_count(abstract_state) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(abstract_state["params"]))


def params_sha256(params) -> str:
    """sha256 over the bytes of every parameter, gathered to host, in sorted key-path order."""
    from jax.experimental import multihost_utils

    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    h = hashlib.sha256()
    for _path, leaf in sorted(leaves, key=lambda kv: jax.tree_util.keystr(kv[0])):
        if jax.process_count() > 1:
            arr = multihost_utils.process_allgather(leaf, tiled=True)
        else:
            arr = jax.device_get(leaf)
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()
