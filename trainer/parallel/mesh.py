"""Devices: the mesh from the config, the one table mapping logical axis names to mesh axes (and the
context that makes it take effect while tracing), and the devices' peak FLOP/s for MFU."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainer.config import ConfigError, MeshConfig, ModelConfig

AXES = ("data", "fsdp", "tensor")

# Dense bf16 peak FLOP/s per device, by substring of jax's device_kind.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "V100": 125e12}

# Logical axis -> mesh axes. Params shard their "embed" dim over fsdp and their wide dims over
# tensor; activations shard the batch over data and fsdp. Model code names only logical axes.
RULES = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),  # grouped-query K/V heads: replicated instead where they do not divide (rules())
    ("mlp", "tensor"),
    ("head_dim", None),
    ("seq", None),
    ("act_embed", None),
    ("norm", None),
    ("layers", None),  # the scanned layer stack: every device holds its shard of every layer
)


def mesh_shape(cfg: MeshConfig, n_devices: int) -> tuple[int, int, int]:
    rest = cfg.fsdp * cfg.tensor
    data = n_devices // rest if cfg.data == -1 else cfg.data
    if data < 1 or data * rest != n_devices:
        raise ConfigError(
            f"mesh data={cfg.data} x fsdp={cfg.fsdp} x tensor={cfg.tensor} does not fit {n_devices} devices"
        )
    return data, cfg.fsdp, cfg.tensor


def make_mesh(cfg: MeshConfig) -> Mesh:
    shape = mesh_shape(cfg, jax.device_count())
    # Order devices process-major so each process's devices form a contiguous block of the batch.
    devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id))).reshape(shape)
    return Mesh(devices, AXES)


def kv_replicated(model: ModelConfig, tensor: int) -> bool:
    """True when the model's K/V heads (model.n_kv_heads) cannot split over the tensor axis: their projection
    and activations are then replicated over it (each tensor shard computes every K/V head it needs)."""
    return bool((model.n_kv_heads or model.n_heads) % tensor)


def rules(mesh: Mesh, model: ModelConfig | None = None) -> tuple:
    """RULES for this model on this mesh."""
    if model is None or not kv_replicated(model, mesh.shape["tensor"]):
        return RULES
    return tuple((name, None if name == "kv_heads" else axes) for name, axes in RULES)


@contextlib.contextmanager
def active(mesh: Mesh, model: ModelConfig | None = None) -> Iterator[None]:
    """Trace under this: the model's logical activation constraints become sharding constraints on the
    mesh (without the mesh and the rules in context flax drops them, and propagation guesses)."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules(mesh, model)):
        yield


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp")))


def batch_shards(mesh: Mesh) -> int:
    """How many shards batch_sharding cuts the global batch into (data x fsdp)."""
    return mesh.shape["data"] * mesh.shape["fsdp"]


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def peak_flops(configured: float) -> float:
    if configured:
        return configured
    kind = jax.devices()[0].device_kind
    return next((v for k, v in PEAK_FLOPS.items() if k in kind), 0.0)
