"""Command line: `python -m trainer --config FILE [--set key=value ...]` and the subcommands.

jax-free until it runs a worker: the supervisor and every subcommand start without the accelerator stack.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import time
import traceback
from pathlib import Path

from trainer import xla_env
from trainer.config import Config, ConfigError, load_config
from trainer.store import env_vars
from trainer.supervise import exit_codes

PEER_DEATH_GRACE_S = 0.5  # see run_worker

SUBCOMMANDS = {  # name: (module, one line for --help)
    "prepare": ("trainer.corpus.prepare", "tokenize a corpus once into a prepared DIR (or import token files)"),
    "status": ("trainer.observe.status", "one-screen health summary of a running or finished run"),
    "report": ("trainer.observe.report", "PNG plots + report.md of a run, into RUN_DIR/report/"),
    "audit": ("trainer.observe.audit", "prove exactly-once data consumption from a run dir"),
    "survival": ("trainer.survival.cli", "run-survival simulator: price the checkpoint interval"),
    "drill": ("trainer.drill.cli", "fire drill: a config under a seeded schedule of faults, checked end to end"),
    "checkpoints": ("trainer.observe.checkpoints", "list a run's checkpoints (both tiers); --verify re-checks them"),
    "inspect": ("trainer.tools.inspect", "compile a config's step without training: bytes, collectives, FLOPs"),
    "export": ("trainer.tools.export", "a checkpoint as a Hugging Face GPT-2 or Llama model dir (safetensors)"),
    "sample": ("trainer.tools.sample", "generate text from a run's checkpoint (greedy at --temperature 0)"),
}
COMMANDS_HELP = (
    "commands:\n"
    + "\n".join(
        [f"  {'--config FILE':<16}train (supervised; --worker: one unsupervised worker); re-run to resume"]
        + [f"  {name:<16}{line}" for name, (_, line) in SUBCOMMANDS.items()]
    )
    + "\n\n`python -m trainer COMMAND --help` for a command's options; README.md for the rest."
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line, like every other input error (argparse prints the usage block first)."""
        flags = [a for act in self._actions for a in act.option_strings]
        bad = message.split(": ", 1)[-1].split()[0] if "unrecognized arguments" in message else ""
        near = difflib.get_close_matches(bad.split("=")[0], flags, n=1) if bad else []
        hint = f"; did you mean {near[0]}?" if near else ""
        self.exit(2, f"error: {message}{hint} (see python -m trainer --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The whole command line as --help shows it (training, and every subcommand by name); parses, runs nothing."""
    p = _Parser(
        prog="python -m trainer",
        description="Fault-tolerant GPT training on a device mesh.",
        usage="python -m trainer --config FILE [--set KEY=VALUE ...] [--worker]\n"
        f"       python -m trainer {{{','.join(SUBCOMMANDS)}}} ...",
        epilog=COMMANDS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config", metavar="FILE", help="YAML file of differences from the defaults (e.g. configs/tiny.yaml)"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key, e.g. --set train.steps=500 (repeatable)",
    )
    p.add_argument("--worker", action="store_true", help="run the training worker in this process, unsupervised")
    return p


def configure_devices(cfg: Config) -> None:
    """Decide the platform, fake device count and XLA flags before jax initialises its backends. Every GPU
    flag and variable the trainer sets is set by trainer.xla_env, with its reason."""
    xla_env.apply(cfg.run)
    if cfg.mesh.cpu_devices:
        os.environ[env_vars.JAX_PLATFORMS] = "cpu"
        import jax

        jax.config.update("jax_num_cpu_devices", cfg.mesh.cpu_devices)


def run_worker(cfg: Config) -> int:
    from trainer.parallel import distributed
    from trainer.train import loop  # jax, flax, optax, orbax, grain: most of a worker's start-up

    if os.environ.get(env_vars.STANDBY):  # started ahead by the supervisor: wait for the attempt to begin
        from trainer.supervise import standby

        standby.wait_for_go(cfg.run.dir)
    configure_devices(cfg)
    me = distributed.initialize(cfg.launch, cpu=bool(cfg.mesh.cpu_devices))

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
        if loop.in_training(e) and exit_codes.is_peer_loss(f"{type(e).__name__}: {e}"):
            # In training, a collective raises this because a peer died (killed, lost its node): this process is
            # a survivor. A peer that failed by itself left at once (exit 1 below), so its report is on its way;
            # a moment for it to land first, then the launcher blames the peer's node, not ours. Every second
            # here is downtime for the whole group, so the grace is short.
            time.sleep(PEER_DEATH_GRACE_S)
            os._exit(exit_codes.PEER_LOST)
        os._exit(2 if isinstance(e, ConfigError) else 1)


def _unknown_command(word: str) -> int:
    near = difflib.get_close_matches(word, list(SUBCOMMANDS), n=1)
    hint = f"did you mean '{near[0]}'? " if near else ""
    print(
        f"error: unknown command '{word}'; {hint}commands: {', '.join(SUBCOMMANDS)}, or --config FILE to train "
        f"(see python -m trainer --help)",
        file=sys.stderr,
    )
    return 2


def main(argv: list[str]) -> int:
    if not argv:  # never a 200-step run of the defaults into runs/default by accident
        build_parser().print_help(sys.stderr)
        return 2
    if argv[0] in SUBCOMMANDS:
        import importlib

        return importlib.import_module(SUBCOMMANDS[argv[0]][0]).main(argv[1:])
    if not argv[0].startswith("-"):
        return _unknown_command(argv[0])
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        from trainer.observe import outcome
        from trainer.store import rundir

        if line := outcome.finished(cfg):  # nothing to do: say so, touch nothing
            print(line, file=sys.stderr)
            return 0
        rundir.check_writable(cfg.run.dir)
        if "://" in cfg.checkpoint.durable_dir:  # a bucket that is missing or refuses us: before any write
            from trainer.store import bucket

            if why := bucket.Bucket(cfg.checkpoint.durable_dir).check():
                if (
                    args.worker and (Path(cfg.run.dir) / rundir.CONFIG).is_file()
                ):  # a restart: the bucket was there; wait for it
                    from trainer.supervise import exit_codes

                    print(f"worker: {why}", file=sys.stderr)
                    return exit_codes.STORAGE
                raise ConfigError(why)
        if args.worker or not cfg.run.supervise:
            return run_worker(cfg)
        from trainer.supervise import supervisor

        return supervisor.main(cfg, args.config, args.set)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
