"""Silent data corruption in training: data-parallel replicas of a parameter must stay bit-identical, so
every device's copy is fingerprinted (one jitted pass over all params, each device summing the uint32 view
of its own buffers) and the copies of each shard are compared. And the `bitflip` fault that makes one
replica differ, for tests and demos.

A mismatch means some device computed or stored something wrong; the state can no longer be trusted, and
the run goes back to its last verified checkpoint (trainer.supervise.replica_rewind).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from trainer.parallel.mesh import AXES

FLIP_BIT = 15  # a low mantissa bit of float32: the value moves by ~4e-3 relative, the loss does not notice


def _fingerprint(x):
    bits = (
        jax.lax.bitcast_convert_type(x, jnp.uint32)
        if x.dtype.itemsize == 4
        else jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    )
    return jnp.sum(bits, dtype=jnp.uint32)  # wraps mod 2**32: any single flipped bit changes it


def _index_key(index: tuple) -> tuple:
    return tuple((s.start, s.stop, s.step) for s in index)


class ReplicaCheck:
    """Compares every parameter's copies across the devices that hold the same shard of it."""

    def __init__(self, mesh: Mesh, params):
        leaves, _ = jax.tree_util.tree_flatten_with_path(params)
        self.names = [jax.tree_util.keystr(p) for p, _ in leaves]
        specs = tuple(leaf.sharding.spec for _, leaf in leaves)

        def local(*xs):  # one device's own buffers -> one fingerprint per leaf
            return jnp.stack([_fingerprint(x) for x in xs]).reshape(len(xs), 1, 1, 1)

        self._fn = jax.jit(
            jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=PartitionSpec(None, *AXES), check_vma=False)
        )
        # Groups of devices holding the same index of each leaf (replicas), and each device's mesh coordinates.
        self.groups = [[g for g in _replica_groups(leaf) if len(g) > 1] for _, leaf in leaves]
        self.coords = {int(d.id): dict(zip(AXES, map(int, c))) for c, d in np.ndenumerate(mesh.devices)}
        self.process_of = {int(d.id): int(d.process_index) for d in mesh.devices.flat}

    def fingerprints(self, params) -> dict[int, np.ndarray]:
        """device id -> per-leaf fingerprints, for every device of every process."""
        out = self._fn(*jax.tree.leaves(params))
        ids = np.array([s.device.id for s in out.addressable_shards], np.int32)
        local = np.stack([np.asarray(s.data).reshape(-1) for s in out.addressable_shards])
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            ids = np.asarray(multihost_utils.process_allgather(ids)).reshape(-1)
            local = np.asarray(multihost_utils.process_allgather(local)).reshape(len(ids), -1)
        return {int(i): row for i, row in zip(ids, local)}

    def check(self, params) -> dict | None:
        """None when every replica agrees; else what disagrees (the same verdict on every process)."""
        fp = self.fingerprints(params)
        for leaf, (name, groups) in enumerate(zip(self.names, self.groups)):
            for devs in groups:
                values = [int(fp[d][leaf]) for d in devs]
                if len(set(values)) > 1:
                    majority = max(set(values), key=values.count)
                    odd = [d for d, v in zip(devs, values) if v != majority] if values.count(majority) > 1 else devs
                    return {
                        "param": name,
                        "devices": [
                            {
                                "device": d,
                                "process": self.process_of[d],
                                **self.coords[d],
                                "fingerprint": v,
                                "odd": d in odd,
                            }
                            for d, v in zip(devs, values)
                        ],
                        "replicas": sorted({self.coords[d]["data"] for d in odd}),
                    }
        return None


def bitflip(state: dict) -> tuple[dict, dict | None]:
    """Flip one bit in one replica's copy of the largest replicated param (the last replica of its first
    shard); every process calls this, the one holding that copy changes it. Returns the new state and
    what was flipped (None on processes that hold nothing to flip)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state["params"])
    replicated = [(i, leaf) for i, (_, leaf) in enumerate(leaves) if max(len(g) for g in _replica_groups(leaf)) > 1]
    assert replicated, "bitflip needs a replicated param: a mesh with data (or another axis) > 1"
    i, leaf = max(replicated, key=lambda il: (il[1].size, -il[0]))
    group = max(_replica_groups(leaf), key=len)
    target = group[-1]
    arrays, done = [], None
    for shard in leaf.addressable_shards:
        if shard.device.id == target:
            buf = np.array(shard.data)
            flat = buf.reshape(-1).view(np.uint32 if buf.dtype.itemsize == 4 else np.uint16)
            flat[flat.size // 2] ^= np.array(1 << (FLIP_BIT % (8 * buf.dtype.itemsize)), flat.dtype)
            arrays.append(jax.device_put(buf, shard.device))
            done = {"param": jax.tree_util.keystr(leaves[i][0]), "device": target, "bit": FLIP_BIT}
        else:
            arrays.append(shard.data)
    if done is None:
        return state, None
    new = list(leaf for _, leaf in leaves)
    new[i] = jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, arrays)
    return dict(state, params=jax.tree.unflatten(treedef, new)), done


def _replica_groups(leaf) -> list[list[int]]:
    by_index: dict[tuple, list[int]] = {}
    for dev, idx in leaf.sharding.devices_indices_map(leaf.shape).items():
        by_index.setdefault(_index_key(idx), []).append(dev.id)
    return [sorted(g) for g in by_index.values()]
