"""The replica check (trainer.train.replicas) on its own, in one process of 8 CPU devices (a mesh of 4 data
replicas x 2 fsdp shards): it passes equal copies, and of four copies of which one had a bit flipped it names
that one, its data replica and its param, for a float32 and for a bfloat16 param. The end-to-end run (a flip
caught and rewound) is tests/test_integrity.py."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT, child_env

_SCRIPT = """
import json
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from trainer.config import MeshConfig
from trainer.train import replicas
from trainer.parallel.mesh import make_mesh

mesh = make_mesh(MeshConfig(data=4, fsdp=2, tensor=1))
params = {
    "w": jax.device_put(jnp.linspace(0.5, 1.5, 64 * 16, dtype=jnp.float32).reshape(64, 16),
                        NamedSharding(mesh, P("fsdp", None))),
    "b": jax.device_put(jnp.linspace(0.25, 0.75, 16, dtype=jnp.bfloat16), NamedSharding(mesh, P())),
}
check = replicas.ReplicaCheck(mesh, params)
out = {"clean": check.check(params)}
flipped, what = replicas.bitflip({"params": params})  # the largest replicated param: w
out["w"], out["w_flipped"] = check.check(flipped["params"]), what
# b's copy on the last device: its lowest mantissa bit flipped (a bfloat16 moves by 2**-7 relative)
b = params["b"]
shards = []
for s in b.addressable_shards:
    buf = np.array(s.data)
    if s.device.id == 7:
        buf.view(np.uint16)[3] ^= np.uint16(1)
    shards.append(jax.device_put(buf, s.device))
odd_b = dict(params, b=jax.make_array_from_single_device_arrays(b.shape, b.sharding, shards))
out["b"] = check.check(odd_b)
out["data_of"] = {d: c["data"] for d, c in check.coords.items()}
print(json.dumps(out))
"""


def _odd(found: dict) -> list[int]:
    return [d["device"] for d in found["devices"] if d["odd"]]


def test_the_replica_check_names_the_one_copy_that_differs_float32_and_bfloat16():
    res = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.splitlines()[-1])
    data_of = {int(d): r for d, r in out["data_of"].items()}
    assert out["clean"] is None  # equal copies pass
    w = out["w"]
    assert w is not None and w["param"] == "['w']", w
    assert len(w["devices"]) == 4 and _odd(w) == [out["w_flipped"]["device"]], w  # one of four copies
    assert w["replicas"] == [data_of[out["w_flipped"]["device"]]], w  # only its data replica is blamed
    b = out["b"]
    assert b is not None and b["param"] == "['b']", "a bfloat16 copy with a flipped bit passed the check"
    assert len(b["devices"]) == 8 and _odd(b) == [7] and b["replicas"] == [data_of[7]], b
