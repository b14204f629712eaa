"""Held-out eval: the mean next-token loss of the model on a fixed set of validation windows, with a
jitted step that reads only the params (no dropout, fp32 loss). It touches neither the RNG, the train
state nor the training iterator, so turning it on never changes training."""

from __future__ import annotations

import math
import time

import jax
import numpy as np

from trainer.model import loss as loss_lib
from trainer.parallel import mesh as mesh_lib
from trainer.train.state import StateSpec


def make_eval_step(spec: StateSpec, mesh):
    model, batch_sharding, shards = spec.model, mesh_lib.batch_sharding(mesh), mesh_lib.batch_shards(mesh)

    def eval_step(params, tokens_BL1):
        # the train step's head and loss, slice by slice
        return loss_lib.next_token_loss(model, params, tokens_BL1, batch_shards=shards)[0]

    return jax.jit(
        eval_step, in_shardings=(spec.shardings["params"], batch_sharding), out_shardings=mesh_lib.replicated(mesh)
    )


class Evaluator:
    """Compiled once at start-up; `run(params)` gives the loss over every fixed eval batch."""

    def __init__(self, spec: StateSpec, mesh, windows_NBL1: np.ndarray):
        self._bsh = mesh_lib.batch_sharding(mesh)
        self._windows = windows_NBL1
        step = make_eval_step(spec, mesh)
        global_rows = windows_NBL1.shape[1] * jax.process_count()
        shape = jax.ShapeDtypeStruct((global_rows, windows_NBL1.shape[2]), np.int32, sharding=self._bsh)
        with mesh_lib.active(mesh, spec.model.cfg):  # the model's activation shardings hold, as in the train step
            self._step = step.lower(spec.abstract["params"], shape).compile()

    def run(self, params) -> dict:
        jax.block_until_ready(params)  # the step just dispatched is the train step's time, not the eval's
        t0 = time.perf_counter()
        losses = [self._step(params, jax.make_array_from_process_local_data(self._bsh, w)) for w in self._windows]
        # Every batch has the same number of tokens: the mean of the batch means is the mean over all of them.
        loss = float(np.mean([float(x) for x in jax.device_get(losses)]))
        return {
            "loss": loss,
            "perplexity": math.exp(min(loss, 700.0)),
            "batches": len(losses),
            "seconds": time.perf_counter() - t0,
        }


def build(w) -> Evaluator | None:
    """The evaluator of a worker with eval on (None when eval.every_steps is 0)."""
    return None if w.eval_windows is None else Evaluator(w.spec, w.mesh, w.eval_windows)
