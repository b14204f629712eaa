"""Cold compile time of the train step by depth, layers scanned (`model.scan=true`) vs unrolled: each
compile in a fresh process with the persistent compilation cache off, the tiny config's width on its 8
fake devices (2x2x2). Scanned, XLA compiles one layer whatever the depth; unrolled, every layer.

    python -m benchmarks.compile_time [--depths 6 12 24] [--out benchmarks/results/compile_time.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks import harness


def _one(overrides: list[str]) -> dict:
    """In a fresh process: trace + lower, then compile, of the tiny config with these overrides."""
    from trainer.__main__ import configure_devices
    from trainer.config import load_config

    cfg = load_config(harness.TINY, ["run.compile_cache=", *overrides])
    configure_devices(cfg)
    from trainer.parallel import mesh as mesh_lib
    from trainer.train.step import lower_train_step
    from trainer.train.worker import state_spec

    mesh = mesh_lib.make_mesh(cfg.mesh)
    spec = state_spec(cfg, mesh)
    t0 = time.perf_counter()
    lowered = lower_train_step(spec, mesh, cfg, microbatches=cfg.train.microbatches)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    return {"trace_lower_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0}


def measure(work: Path, depths: list[int]) -> dict:
    rows = []
    for depth in depths:
        for scan in (True, False):
            out = work / f"compile-{depth}-{scan}.json"
            overrides = [f"model.n_layers={depth}", f"model.scan={str(scan).lower()}"]
            load = os.getloadavg()[0]
            harness.run(
                [sys.executable, "-m", "benchmarks.compile_time", "--one", str(out), *overrides],
                work / f"compile-{depth}-{scan}.log",
                timeout=1800,
            )
            rows.append(
                {
                    "n_layers": depth,
                    "scan": scan,
                    **json.loads(out.read_text()),
                    "loadavg_before": load,
                    "loadavg_after": os.getloadavg()[0],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return {"rows": rows, "cpus": os.cpu_count()}


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--one":
        Path(argv[1]).write_text(json.dumps(_one(argv[2:])))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depths", type=int, nargs="+", default=[6, 12, 24])
    p.add_argument("--work", type=Path, default=Path(f"/tmp/trainer-compile-time-{os.getpid()}"))
    p.add_argument("--out", type=Path, default=harness.ROOT / "benchmarks" / "results" / "compile_time.json")
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    result = measure(args.work, args.depths)
    result["command"] = " ".join(["python -m benchmarks.compile_time", *argv])
    result.update(harness.provenance())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
