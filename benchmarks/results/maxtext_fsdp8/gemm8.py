"""Aggregate GEMM rate of N fake CPU devices in one process (default 8, the fsdp8 setting) on this machine.

Each device multiplies its [512, 256] rows by [256, 1024] then [1024, 256] (the MLP's shapes in the fsdp8 step),
20 times in a loop, with the dot written three ways: f32 x f32 -> f32, bf16 x bf16 -> bf16 (what our Linear and
MaxText's DenseGeneral emit) and bf16 x bf16 -> f32 (preferred_element_type) cast to bf16. Prints GFLOP/s summed
over the devices and the result type of the dots XLA:CPU compiled (f32 = the GEMM ran in f32).

    JAX_PLATFORMS=cpu python gemm8.py [N]     # with each venv's python: jaxlib 0.10.2 and 0.12.0.1
"""

import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

ROWS_PER_DEVICE, STEPS = 512, 20


def dot(form, a, b):
    if form == "f32":
        return a.astype(jnp.float32) @ b.astype(jnp.float32)
    if form == "bf16->bf16":
        return a @ b
    return jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)  # bf16->f32


def chain(form):
    def f(x, w1, w2):
        body = lambda i, x: dot(form, dot(form, x, w1), w2).astype(jnp.bfloat16) * jnp.bfloat16(0.5)  # noqa: E731
        return jax.lax.fori_loop(0, STEPS, body, x)

    return f


def main(n: int) -> None:
    jax.config.update("jax_num_cpu_devices", n)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    rows = ROWS_PER_DEVICE * n
    x = jax.device_put(jnp.full((rows, 256), 0.01, jnp.bfloat16), NamedSharding(mesh, P("d")))
    w1 = jax.device_put(jnp.full((256, 1024), 0.01, jnp.bfloat16), NamedSharding(mesh, P()))
    w2 = jax.device_put(jnp.full((1024, 256), 0.01, jnp.bfloat16), NamedSharding(mesh, P()))
    flops = STEPS * 2 * 2 * rows * 256 * 1024
    for form in ("f32", "bf16->bf16", "bf16->f32"):
        g = jax.jit(chain(form))
        text = g.lower(x, w1, w2).compile().as_text()
        results = sorted(
            {
                re.sub(r"\{[0-9,]*\}", "", line.split("= ")[1].split(" dot(")[0])
                for line in text.splitlines()
                if " dot(" in line
            }
        )
        g(x, w1, w2).block_until_ready()
        best = float("inf")
        for _ in range(4):
            t = time.perf_counter()
            g(x, w1, w2).block_until_ready()
            best = min(best, time.perf_counter() - t)
        print(
            f"jax {jax.__version__} {n} devices  {form:11s} {flops / best / 1e9:7.1f} GFLOP/s  compiled dots: {results}"
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
