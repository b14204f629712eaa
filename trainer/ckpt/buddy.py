"""Fast-tier copies held by a peer node: so that losing one node whole (its processes, GPUs and node-local
disk at once) still leaves a complete local checkpoint among the survivors.

At each local save, every process's shards are also sent to one process on another node, its buddy,
which writes them into its own local checkpoint beside its own shards (item `buddy`). The transfer is
jax's: the state is put onto the same sharding over a mesh whose devices are permuted process by process
(`jax.device_put` to a NamedSharding with the same devices in another order compiles to a collective
permute: NCCL over NVLink/InfiniBand on GPUs, gloo over TCP on CPU). It moves device to device, over the
fastest links the cluster has, without passing through the coordinator or the shared file system.

On restore, each process that has lost its shards gets them back the same way: the process holding the
copy reads it from its disk onto its own devices, standing in the lost process's place in a permuted
mesh, and a device_put onto the real sharding moves it over. Orbax reads and writes the files.

Pairing: processes are ordered by node (in the order nodes first appear), and process i's copy goes to the
process `per_node` places later, cyclically: the next node's process at the same local rank. With one node
there is no buddy (a copy on the same disk survives nothing more).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainer.observe import heartbeat
from trainer.parallel.distributed import allgather_json


def node_name() -> str:
    """This process's node (trainer.observe.heartbeat.node_name)."""
    return heartbeat.node_name(jax.process_index())


@dataclass(frozen=True)
class Pairing:
    nodes: list[str]  # the node of each process, by process index
    to: list[int]  # to[i]: the process that holds process i's copy (a permutation; never on i's node)

    @property
    def held(self) -> int:
        """Whose copy this process holds."""
        return self.to.index(jax.process_index())


def nodes_of_processes() -> list[str]:
    """Every process's node name, in process order (one host collective)."""
    return [str(n) for n in allgather_json(node_name())]


def pair(nodes: list[str]) -> Pairing | None:
    """The buddy of every process, or None when there is a single node or the processes are not spread
    evenly enough for every copy to land on another node."""
    order = list(dict.fromkeys(nodes))
    if len(order) < 2:
        return None
    ranked = sorted(range(len(nodes)), key=lambda i: (order.index(nodes[i]), i))
    per_node = len(nodes) // len(order)
    to = [0] * len(nodes)
    for pos, i in enumerate(ranked):
        to[i] = ranked[(pos + per_node) % len(ranked)]
    if any(nodes[i] == nodes[to[i]] for i in range(len(nodes))):
        return None
    return Pairing(nodes, to)


def permuted(sharding: NamedSharding, stand_in: dict[int, int]) -> NamedSharding:
    """`sharding` with the devices of process t replaced, position by position, by those of process
    stand_in[t] (a permutation of processes; missing ones stand for themselves). Data laid out on the
    result sits on stand_in[t]'s devices where the original layout puts t's."""
    mesh = sharding.mesh
    by_process: dict[int, list] = {}
    for d in mesh.devices.flat:
        by_process.setdefault(d.process_index, []).append(d)
    for devs in by_process.values():
        devs.sort(key=lambda d: d.id)

    def swap(d):
        mine = by_process[d.process_index]
        return by_process[stand_in.get(d.process_index, d.process_index)][mine.index(d)]

    devices = np.vectorize(swap, otypes=[object])(mesh.devices)
    return NamedSharding(Mesh(devices, mesh.axis_names), sharding.spec, memory_kind=sharding.memory_kind)


def complete(stand_in: dict[int, int], processes: int) -> dict[int, int]:
    """A partial injective map of processes made a permutation: the unused processes fill the gaps in order."""
    free = [p for p in range(processes) if p not in stand_in.values()]
    out = dict(stand_in)
    for t in range(processes):
        if t not in out:
            out[t] = free.pop(0)
    return out


def send(state: Any, pairing: Pairing) -> Any:
    """Every process's shards of `state`, moved onto its buddy's devices (a collective: every process calls it).
    The result's shards on this process are the ones `pairing.held` owns in `state`'s layout."""
    stand_in = dict(enumerate(pairing.to))
    return jax.device_put(state, jax.tree.map(lambda a: permuted(a.sharding, stand_in), state))


def abstract_as(abstract: Any, stand_in: dict[int, int]) -> Any:
    """The restore target for reading another process's shards onto this process's devices."""
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=permuted(a.sharding, stand_in)), abstract
    )


def move(tree: Any, stand_in: dict[int, int], abstract: Any) -> Any:
    """One transfer round of a restore: `tree` (None on a process with nothing to give) was read by each
    holder h onto its devices standing in for target t (stand_in[t] = h, `abstract_as`). Returns arrays on
    `abstract`'s shardings whose shards on each target are its own; elsewhere the values are meaningless.

    Each device's shards, all leaves together, travel as the bytes of one row of a uint8 array sharded over
    every device: one compiled transfer per round whatever the number of leaves (a transfer per leaf would
    compile one each), and no replication for the transfer to optimise away (a device_put of the replicated
    layout itself would be free to keep each device's own replica: jax assumes replicas are equal, and the
    processes with nothing to give hold no valid replica). Costs a host copy of the shards on both ends."""
    leaves, treedef = jax.tree.flatten(abstract)
    mesh = leaves[0].sharding.mesh
    devices = sorted(mesh.devices.flat, key=lambda d: (d.process_index, d.id))
    local = {p: [d for d in devices if d.process_index == p] for p in {d.process_index for d in devices}}
    back = {h: t for t, h in stand_in.items()}  # a holder's device goes to its target's at the same local rank
    dest = [local[back.get(d.process_index, d.process_index)][local[d.process_index].index(d)] for d in devices]
    shapes = [a.sharding.shard_shape(a.shape) for a in leaves]
    sizes = [int(np.prod(shape)) * np.dtype(a.dtype).itemsize for shape, a in zip(shapes, leaves)]
    given = [{s.device: s.data for s in x.addressable_shards} for x in jax.tree.leaves(tree)] if tree else []

    def row(d) -> jax.Array:
        raw = b"".join(np.asarray(g[d]).tobytes() for g in given) if given else bytes(sum(sizes))
        return jax.device_put(np.frombuffer(raw, np.uint8)[None], d)

    rows = jax.make_array_from_single_device_arrays(
        (len(devices), sum(sizes)),
        NamedSharding(Mesh(np.array(devices), ("rows",)), PartitionSpec("rows")),
        [row(d) for d in local[jax.process_index()]],
    )
    moved = jax.device_put(rows, NamedSharding(Mesh(np.array(dest), ("rows",)), PartitionSpec("rows")))
    arrived = {s.device: np.asarray(s.data)[0] for s in moved.addressable_shards}
    del rows, moved
    out, offset = [], 0
    for a, shape, size in zip(leaves, shapes, sizes):
        order = list(a.sharding.addressable_devices_indices_map(a.shape))
        pieces = [jax.device_put(arrived[d][offset : offset + size].view(a.dtype).reshape(shape), d) for d in order]
        out.append(jax.make_array_from_single_device_arrays(a.shape, a.sharding, pieces))
        offset += size
    return jax.tree.unflatten(treedef, out)


def rounds(holder: dict[int, int]) -> Iterable[dict[int, int]]:
    """The transfers for targets whose holder is another process, grouped so that no process gives twice in
    one round: each round is {target: holder}."""
    todo = {t: h for t, h in holder.items() if t != h}
    while todo:
        used: set[int] = set()
        batch = {}
        for t, h in sorted(todo.items()):
            if h not in used:
                batch[t] = h
                used.add(h)
        for t in batch:
            del todo[t]
        yield batch
