"""The LM head + cross-entropy over slices of the sequence (trainer.model.loss): the same loss and gradients as
autodiff of the whole logits, bf16 operands in every matmul with the vocabulary (XLA's compiled HLO), and
temporaries below one fp32 copy of the logits."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from trainer.config import ModelConfig
from trainer.model import loss as loss_lib
from trainer.model.model import GPT
from trainer.tools import hlo


def _model(dt: str, vocab: int = 384, chunk: int = 0, seq: int = 32) -> GPT:
    # one layer, unrolled: the loss sees only the final norm's output and the head, whatever the depth
    cfg = ModelConfig(vocab_size=vocab, seq_len=seq, d_model=64, n_layers=1, n_heads=4, compute_dtype=dt, scan=False)
    return GPT(dataclasses.replace(cfg, loss_chunk=chunk))


def _reference(model, params, tokens, z_loss):
    """Autodiff of the whole logits: optax's cross-entropy plus the z-loss on their logsumexp."""
    logits = model.apply({"params": params}, tokens[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return ce + z_loss * jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))


# bf16's gradients differ by the rounding of d logits to bf16 for the backward matmuls (~1% of the largest).
@pytest.mark.parametrize(
    "dt,grad_tol,chunk,z_loss", [("float32", 1e-5, 8, 1e-2), ("bfloat16", 3e-2, 0, 0.0), ("bfloat16", 3e-2, 8, 1e-2)]
)
def test_sliced_head_loss_matches_autodiff_of_the_whole_logits(dt, grad_tol, chunk, z_loss):
    model = _model(dt, chunk=chunk)
    tokens = jax.random.randint(jax.random.key(1), (4, 33), 0, 384)
    params = model.init(jax.random.key(0), tokens[:, :-1])["params"]
    ref_loss, ref_g = jax.jit(jax.value_and_grad(lambda p: _reference(model, p, tokens, z_loss)))(params)
    new = lambda p: loss_lib.next_token_loss(model, p, tokens, z_loss=z_loss)[1]  # noqa: E731
    loss, g = jax.jit(jax.value_and_grad(new))(params)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * float(ref_loss)
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(ref_g), jax.tree.leaves(ref_g), jax.tree.leaves(g)):
        scale = float(jnp.max(jnp.abs(a)))
        assert float(jnp.max(jnp.abs(a - b))) <= grad_tol * scale, jax.tree_util.keystr(path[0])


def test_auto_chunk_keeps_a_slice_of_logits_under_its_bytes():
    assert loss_lib.auto_chunk(16, 128, 384) == 128  # tiny: one slice
    assert loss_lib.auto_chunk(32, 1024, 50304) == 128  # GPT-2 124M on one device: 8 slices of 0.82 GB
    assert loss_lib.auto_chunk(8, 2048, 50304) == 512  # gpt-1b, a device of FSDP 8: 4 slices
    for b, n, v in ((32, 1024, 50304), (64, 2048, 50304), (1, 7, 10**9)):
        c = loss_lib.auto_chunk(b, n, v)
        assert n % c == 0 and (c == 1 or b * c * v * 4 <= loss_lib.SLICE_BYTES)


def _compiled(vocab: int):
    model = _model("bfloat16", vocab=vocab, chunk=16, seq=64)
    tokens = jax.ShapeDtypeStruct((8, 65), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 64), jnp.int32))["params"])
    return jax.jit(jax.grad(lambda p, t: loss_lib.next_token_loss(model, p, t)[0])).lower(params, tokens).compile()


def test_vocab_matmuls_take_bf16_and_the_logits_are_never_whole():
    """From XLA's compiled step: the three matmuls with a vocabulary-sized operand dimension (the logits and
    both gradient matmuls, none recomputed) take bf16 operands in the program, and the temporaries the
    vocabulary adds (against the same step at a small vocabulary) stay below one fp32 copy of the logits."""
    V, tokens = 8192, 8 * 64
    big = _compiled(V)
    vocab_mms = [m for m in hlo.analyze(big.as_text()).matmuls if any(V in dims for _, dims in m.operands)]
    assert len(vocab_mms) == 3, vocab_mms  # the logits, d x and d head: no recompute of the logits
    for m in vocab_mms:
        assert (m.program_dtypes or m.operand_dtypes) == ("bf16", "bf16"), m
    added = big.memory_analysis().temp_size_in_bytes - _compiled(384).memory_analysis().temp_size_in_bytes
    assert added < tokens * V * 4, (added, tokens * V * 4)
    assert np.isfinite(added)
