"""#8 The replica check's cost (`integrity.replica_check_steps`): one fingerprint pass over every device's
copy of the params plus the host-side comparison, vs one train step, on 8 fake CPU devices as a
data 2 x fsdp 2 x tensor 2 mesh (the tiny config's), for the tiny model and a ~25M-param one.
Per-step overhead at interval N is (check s) / (N x step s).
"""

from __future__ import annotations

import os
import sys
import time

from benchmarks import harness

MESH = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
MODELS = {
    "tiny": ["model.seq_len=128", "model.d_model=192", "model.n_layers=4", "model.n_heads=6", "data.batch_size=16"],
    "25M": ["model.seq_len=128", "model.d_model=512", "model.n_layers=8", "model.n_heads=8", "data.batch_size=16"],
}
INTERVAL = 10  # the interval the headline figure is given for


def _one(overrides: list[str], reps: int) -> dict:
    from benchmarks.checkpoint_cost import _Bench
    from trainer.train.replicas import ReplicaCheck

    b = _Bench([*MESH, *overrides])
    b.steps(3)
    t0 = time.perf_counter()
    b.steps(reps)
    step_s = (time.perf_counter() - t0) / reps
    mesh = b.jax.tree.leaves(b.spec.shardings["params"])[0].mesh
    check = ReplicaCheck(mesh, b.spec.abstract["params"])
    assert check.check(b.state["params"]) is None  # compiles; replicas agree
    t0 = time.perf_counter()
    for _ in range(reps):
        assert check.check(b.state["params"]) is None
    check_s = (time.perf_counter() - t0) / reps
    return {
        "n_params": b.n_params,
        "step_s": step_s,
        "check_s": check_s,
        "check_vs_step": check_s / step_s,
        f"overhead_per_step_at_{INTERVAL}": check_s / (INTERVAL * step_s),
    }


def measure(quick: bool) -> dict:
    out = {name: _one(over, 3 if quick else 10) for name, over in MODELS.items() if not (quick and name != "tiny")}
    overhead = out["tiny"][f"overhead_per_step_at_{INTERVAL}"]
    return {
        f"replica_check_overhead_at_{INTERVAL}": overhead,
        "models": out,
        "met": {f"replica_check_overhead_at_{INTERVAL}": overhead <= 0.01},
        "setup": f"8 fake CPU devices, mesh {' '.join(MESH)}; compiled train step over pre-loaded batches vs "
        "trainer.train.replicas.ReplicaCheck.check (jitted per-device fingerprints, gathered, compared)",
    }


def main(argv: list[str]) -> int:
    args = harness.cli(__doc__.splitlines()[0], argv)
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    harness.emit(args, measure(args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
