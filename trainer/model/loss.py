"""The LM head and the cross-entropy in one function, over slices of the sequence, so that the step never holds
the whole (tokens x vocab) logits: at GPT-2 124M's batch (32 x 1024 tokens, vocab 50304) those are 6.6 GB in
fp32, and their gradient as much again. Levanter (blockwise cross-entropy over the vocabulary) and MaxText
(vocabulary tiling) slice for the same reason.

`head_loss(x_BLD, head_DV, labels_BL, chunk, shards, z_loss)` gives the mean cross-entropy plus z_loss x
mean(lse^2) (what the step differentiates) and the mean cross-entropy alone (what it reports). The loss is the
step's last op and a scalar, so its gradient is known up to that scalar's cotangent while each slice's logits
are at hand: the forward pass forms d logits = (1 + 2 z_loss lse) / N x softmax - onehot / N in fp32, casts it to
the compute dtype and runs both gradient matmuls there, on compute-dtype operands with fp32 accumulation, and
keeps only d x ([B, L, D], the size of x, which it replaces as the residual) and d head. The backward pass
scales them by the incoming cotangent (1 in a train step). Three head matmuls a step, as autodiff of the whole
logits does, not four (recomputing the logits in the backward would add a third of the head's FLOPs: 6% of
GPT-2 124M's step); in bf16 all three run at the tensor cores' bf16 rate (autodiff of the plain einsum takes
the fp32 logits' cotangent as an operand, so its two backward matmuls run in fp32). The head's gradient sums
per batch shard over the slices in fp32, across shards once, and is rounded to the head's dtype once, as every
other kernel's is.

The label's logit is a one-hot masked sum, not a gather: with the vocabulary sharded over the tensor axis
each shard sums its own columns and one all-reduce adds them (a gather would collect the logits first).
Slices run in order under lax.scan: the same program for a run and its resume, so resume stays bitwise.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

LOGITS = ("batch", "seq", "vocab")
SLICE_BYTES = 1 << 30  # auto slices: at most 1 GiB of fp32 logits per device per slice


def auto_chunk(batch: int, seq_len: int, vocab: int) -> int:
    """Positions per slice: the largest power-of-two divisor of seq_len (or seq_len itself) whose fp32
    logits for `batch` sequences (a device's share) fit SLICE_BYTES; at least one position. GPT-2 124M on one
    GPU (32 x 1024, vocab 50304): 128 positions, 8 slices of 0.8 GB; gpt-1b over FSDP 8 (8 x 2048 a device):
    512, 4 slices; the tiny CPU configs: the whole sequence, one slice. Fewer, larger slices keep the head's
    matmuls large enough for the tensor cores."""
    if batch * seq_len * vocab * 4 <= SLICE_BYTES:
        return seq_len
    chunk = 1
    while seq_len % (chunk * 2) == 0 and batch * chunk * 2 * vocab * 4 <= SLICE_BYTES:
        chunk *= 2
    return chunk


def _slices(a, chunk: int):
    """[B, L, ...] -> [L / chunk, B, chunk, ...]: scan's leading axis, the batch (and its sharding) kept."""
    B, L = a.shape[:2]
    return jnp.moveaxis(a.reshape(B, L // chunk, chunk, *a.shape[2:]), 1, 0)


def _unslice(a):
    """[C, B, chunk, ...] -> [B, C * chunk, ...]."""
    a = jnp.moveaxis(a, 0, 1)
    return a.reshape(a.shape[0], a.shape[1] * a.shape[2], *a.shape[3:])


def _logits(x_BCD, head_DV):
    logits = jnp.einsum("BCD,DV->BCV", x_BCD, head_DV, preferred_element_type=jnp.float32)
    return nn.with_logical_constraint(logits, LOGITS)


def _is_label(labels_BC, V: int):
    return jax.lax.broadcasted_iota(jnp.int32, (*labels_BC.shape, V), 2) == labels_BC[..., None]


def _gathered(head_DV):
    """The head whole along D (FSDP's shards gathered) before the slices' loop: inside it XLA gathers it again
    at every slice."""
    return nn.with_logical_constraint(head_DV, (None, "vocab"))


def _lse_and_label(logits_BCV, labels_BC):
    lse_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
    return lse_BC, jnp.sum(jnp.where(_is_label(labels_BC, logits_BCV.shape[-1]), logits_BCV, 0.0), axis=-1)


def _losses(lse_BL, label_BL, z_loss: float):
    ce = jnp.mean(lse_BL - label_BL)
    return (ce + z_loss * jnp.mean(jnp.square(lse_BL)) if z_loss else ce), ce


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def head_loss(x_BLD, head_DV, labels_BL, chunk: int, shards: int = 1, z_loss: float = 0.0):
    """(mean cross-entropy + z_loss x mean(lse^2), mean cross-entropy) of logits = x @ head (operands in their
    dtype, fp32 accumulation), `chunk` positions at a time; `shards`: how many shards the batch is cut into.
    Only the first carries gradients (the second is for reporting; without z_loss the two are one value)."""
    head_DV = _gathered(head_DV)

    def one(_, xs):
        x_BCD, labels_BC = xs
        return None, _lse_and_label(_logits(x_BCD, head_DV), labels_BC)

    _, (lse, label) = jax.lax.scan(one, None, (_slices(x_BLD, chunk), _slices(labels_BL, chunk)))
    return _losses(_unslice(lse), _unslice(label), z_loss)


def _fwd(x_BLD, head_DV, labels_BL, chunk, shards, z_loss):
    (B, L, D), (_, V), dt, S = x_BLD.shape, head_DV.shape, head_DV.dtype, shards
    whole_head, n = _gathered(head_DV), B * L
    # The head's gradient is summed per batch shard ([S, D, V], S sharded like the batch) and across shards
    # once, after the last slice: a [D, V] sum would be reduced across the devices at every slice.
    per_shard = ("batch", None, "vocab")
    by_shard = lambda a: nn.with_logical_constraint(a.reshape(S, B // S, *a.shape[1:]), ("batch",))  # noqa: E731

    def one(dhead_SDV, xs):
        x_BCD, labels_BC = xs
        logits_BCV = _logits(x_BCD, whole_head)
        lse_BC, label_BC = _lse_and_label(logits_BCV, labels_BC)
        # d total / d logits: d lse = (1 + 2 z_loss lse) / N times the softmax, d label logit = -1 / N
        d_lse_BC = (1.0 + 2.0 * z_loss * lse_BC) / n if z_loss else jnp.full_like(lse_BC, 1.0 / n)
        probs_BCV = jnp.exp(logits_BCV - lse_BC[..., None])
        dlogits_BCV = d_lse_BC[..., None] * probs_BCV - jnp.where(_is_label(labels_BC, V), 1.0 / n, 0.0)
        dlogits_BCV = nn.with_logical_constraint(dlogits_BCV.astype(dt), LOGITS)
        dx_BCD = jnp.einsum("BCV,DV->BCD", dlogits_BCV, whole_head, preferred_element_type=jnp.float32)
        d_SDV = jnp.einsum("SbCD,SbCV->SDV", by_shard(x_BCD), by_shard(dlogits_BCV), preferred_element_type=jnp.float32)
        dhead_SDV = nn.with_logical_constraint(dhead_SDV + d_SDV, per_shard)
        return dhead_SDV, (lse_BC, label_BC, dx_BCD.astype(x_BLD.dtype))

    zeros = nn.with_logical_constraint(jnp.zeros((S, D, V), jnp.float32), per_shard)
    xs = (_slices(x_BLD, chunk), _slices(labels_BL, chunk))
    dhead_SDV, (lse, label, dx) = jax.lax.scan(one, zeros, xs)
    dhead_DV = nn.with_logical_constraint(dhead_SDV.sum(0), ("embed", "vocab"))  # reduced into the head's shards
    return _losses(_unslice(lse), _unslice(label), z_loss), (_unslice(dx), dhead_DV.astype(dt))


def _bwd(chunk, shards, z_loss, res, cts):
    dx_BLD, dhead_DV = res
    g = cts[0]  # the reported cross-entropy's cotangent is ignored: see head_loss
    return (g * dx_BLD).astype(dx_BLD.dtype), (g * dhead_DV).astype(dhead_DV.dtype), None


head_loss.defvjp(_fwd, _bwd)


def next_token_loss(
    model, params, tokens_BL1, *, z_loss: float = 0.0, deterministic: bool = True, rngs=None, batch_shards: int = 1
):
    """(cross-entropy, cross-entropy + z_loss x mean(lse^2)): the mean next-token loss of `model` (a GPT) on
    tokens [B, L + 1], the logits made and consumed `model.loss_chunk` positions at a time (0: auto_chunk for
    a device's B / batch_shards sequences). Differentiate the second (the first carries no gradient when
    z_loss is set)."""
    inputs_BL, labels_BL = tokens_BL1[:, :-1], tokens_BL1[:, 1:]
    x_BLD, head_DV = model.apply({"params": params}, inputs_BL, deterministic=deterministic, rngs=rngs, hidden=True)
    B, L = inputs_BL.shape
    chunk = model.cfg.loss_chunk or auto_chunk(max(1, B // batch_shards), L, head_DV.shape[1])
    total, ce = head_loss(x_BLD, head_DV, labels_BL, chunk, batch_shards, float(z_loss))
    return (ce, total) if z_loss else (total, total)
