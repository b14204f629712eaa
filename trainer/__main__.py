"""Command line: `python -m trainer --config FILE [--set key=value ...]` and the subcommands.

jax-free until it runs a worker: the supervisor and every subcommand start without the accelerator stack.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from trainer.config import Config, ConfigError, load_config

SUBCOMMANDS = {
    "prepare": "trainer.corpus.prepare",  # tokenize a corpus once into a prepared DIR (or import token files)
    "survival": "trainer.survival.cli",  # run-survival simulator
    "status": "trainer.observe.status",  # one-screen health summary of a running or finished run
    "report": "trainer.observe.report",  # PNG plots + report.md of a run into RUN_DIR/report/
    "audit": "trainer.observe.audit",  # prove exactly-once data consumption from a run dir
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer", description="Fault-tolerant GPT training on a device mesh.")
    p.add_argument("--config", help="YAML file of differences from the defaults (e.g. configs/tiny.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key, e.g. --set train.steps=500 (repeatable)")
    p.add_argument("--worker", action="store_true", help="run the training worker in this process, unsupervised")
    return p


def configure_devices(cfg: Config) -> None:
    """Decide the platform and fake device count before jax initialises its backends."""
    if cfg.mesh.cpu_devices:
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax

        jax.config.update("jax_num_cpu_devices", cfg.mesh.cpu_devices)


def run_worker(cfg: Config) -> int:
    configure_devices(cfg)
    from trainer.core import distributed

    me = distributed.initialize(cfg.launch, cpu=bool(cfg.mesh.cpu_devices))
    from trainer.core import loop

    if me.processes <= 1:
        return loop.run(cfg)
    try:
        return loop.run(cfg)
    except BaseException as e:
        # One of several processes: a normal interpreter exit runs jax's atexit hook, whose
        # jax.distributed.shutdown() waits at a barrier for peers that are stuck in a collective or in
        # start-up waiting for this process (minutes, until the coordination service gives up). Say
        # what went wrong and leave now: the launcher tears the peers down within a poll.
        if isinstance(e, ConfigError):
            print(f"error: {e}", file=sys.stderr)
        else:
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2 if isinstance(e, ConfigError) else 1)


def main(argv: list[str]) -> int:
    if argv and argv[0] in SUBCOMMANDS:
        import importlib

        return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
    args = _parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        if args.worker or not cfg.run.supervise:
            return run_worker(cfg)
        from trainer.supervise import supervisor

        return supervisor.main(cfg, args.config, args.set)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
