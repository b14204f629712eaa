"""The train state (trainer.train.state) as the worker builds it: a fresh state is a function of run.seed (the
params and the dropout key both), starts at step 0, and matches the abstract state restores are read into."""

from __future__ import annotations

import jax
import numpy as np

from trainer.config import MeshConfig, ModelConfig, OptimConfig
from trainer.model.model import GPT
from trainer.parallel.mesh import make_mesh
from trainer.train import state
from trainer.train.optim import make_optimizer

CFG = ModelConfig(vocab_size=128, seq_len=16, d_model=32, n_layers=1, n_heads=2)


def _fresh(seed: int):
    mesh = make_mesh(MeshConfig(data=-1, fsdp=1, tensor=1))
    spec = state.build(GPT(CFG), make_optimizer(OptimConfig(), CFG), mesh, seed=seed, seq_len=CFG.seq_len)
    return spec, spec.init()


def test_a_fresh_state_is_a_function_of_the_seed_and_matches_its_restore_target():
    spec, a = _fresh(0)
    _, other = _fresh(1)
    assert int(a["step"]) == 0
    # What a restore reads into (spec.abstract) is what init makes: the same tree, shapes, dtypes, shardings.
    assert jax.tree.structure(a) == jax.tree.structure(spec.abstract)
    same = jax.tree.map(lambda x, t: (x.shape, x.dtype, x.sharding) == (t.shape, t.dtype, t.sharding), a, spec.abstract)
    assert all(jax.tree.leaves(same))
    again = spec.init()
    assert state.params_sha256(a["params"]) == state.params_sha256(again["params"])
    assert np.array_equal(a["rng"], again["rng"])
    # Another seed, other params and another dropout key.
    assert state.params_sha256(a["params"]) != state.params_sha256(other["params"]), "run.seed is not the init's"
    assert not np.array_equal(a["rng"], other["rng"])
    # The dropout key is not the key the params were drawn with.
    init_key = jax.random.key_data(jax.random.split(jax.random.key(0))[0])
    assert not np.array_equal(a["rng"], init_key)
