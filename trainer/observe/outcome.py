"""A run's outcome in one line each (fresh start, resume, complete, stopped, with where to look), and the check
that a run dir already holds what a command asks for, so that re-running a finished run changes no byte of
it. Reads the run dir's files alone: no jax, answered before a worker starts.
"""

from __future__ import annotations

from pathlib import Path

from trainer.config import FROZEN_KEYS, Config, ConfigError, to_dict
from trainer.observe import goodput, runview
from trainer.observe.events import events_newest_first, read_events
from trainer.observe.progress import fmt_loss
from trainer.store import ckpt_files as checkpoint_files
from trainer.store import rundir, summary
from trainer.store.event_names import (
    ATTEMPT_STARTS,
    INIT,
    RESTART,
    RUN_COMPLETE,
    SESSION_STARTS,
    WORKER_FINISHED,
    WORKER_START,
)

# What must match the run dir's config.yaml for "already finished" to be the answer; any other change to
# these goes to the worker, which refuses it (or, for data, compares the corpus fingerprint).
SAME_RUN_KEYS = (*FROZEN_KEYS, "data.path", "data.default_corpus_mb")


def checkpoint_steps(run_dir: Path) -> list[int]:
    """Committed checkpoint steps (Orbax renames a step directory into place only once it is complete)."""
    return checkpoint_files.committed_steps(checkpoint_files.durable_dir(run_dir))


def begin_line(
    run_dir: Path,
    start: int,
    *,
    steps: int,
    n_params: int,
    mesh: dict[str, int],
    tier: str | None = None,
    init_from: dict | None = None,
) -> str:
    """The first line of an attempt: a fresh start (from another run's params with train.init_from), or the
    checkpoint it resumed from."""
    if start:
        where = (
            "the node-local tier"
            if tier == checkpoint_files.LOCAL
            else checkpoint_files.durable_dir(run_dir) / str(start)
        )
        return f"resumed from step {start} of checkpoint {where}; training to step {steps}"
    devices = 1
    for v in mesh.values():
        devices *= v
    shape = " x ".join(f"{k} {v}" for k, v in mesh.items())
    source = f", params from {init_from['checkpoint']} (train.init_from)" if init_from else ""
    return (
        f"fresh start: {steps} steps of a {n_params / 1e6:.3g}M-param model on {devices} devices ({shape}) "
        f"into {run_dir}{source}"
    )


def complete_line(run_dir: Path, step: int) -> str:
    run_dir = Path(run_dir)
    loss = fmt_loss((summary.read(run_dir) or {}).get("final_loss"))
    parts = [f"run complete at step {step}: {run_dir / rundir.SUMMARY} (final loss {loss})"]
    if (md := run_dir / rundir.REPORT / rundir.REPORT_MD).is_file():
        parts.append(f"report {md}")
    if (run_dir / rundir.TENSORBOARD).is_dir():
        parts.append(f"TensorBoard: tensorboard --logdir {run_dir / rundir.TENSORBOARD}")
    return "; ".join(parts)


def stopped_line(run_dir: Path, step: int) -> str:
    where = checkpoint_files.durable_dir(run_dir) / str(step)
    return (
        f"stopped at step {step} (train.stop_at_step): checkpoint {where}; raise train.stop_at_step, or set it "
        f"to 0, and re-run to continue"
    )


def worker_end(run_dir: Path) -> dict | None:
    """The event with which the worker of the latest session ended the run on purpose, if it did."""
    for e in events_newest_first(Path(run_dir) / rundir.EVENTS):
        if e.get("event") in WORKER_FINISHED and "by" not in e:
            return e
        if e.get("event") in (*SESSION_STARTS, WORKER_START, *ATTEMPT_STARTS):
            return None
    return None


def end_line(run_dir: Path) -> str | None:
    e = worker_end(run_dir)
    if e is None:
        return None
    return complete_line(run_dir, e["step"]) if e["event"] == RUN_COMPLETE else stopped_line(run_dir, e["step"])


def finished(cfg: Config) -> str | None:
    """The line to print instead of training when the run dir already holds what `cfg` asks for (the run
    complete at train.steps, or stopped at train.stop_at_step), else None: then a worker runs as usual."""
    run_dir = Path(cfg.run.dir)
    steps = checkpoint_steps(run_dir)
    if not steps or steps[-1] < (cfg.train.stop_at_step or cfg.train.steps) or not _same_run(run_dir, cfg):
        return None
    newest = steps[-1]
    if newest < cfg.train.steps:
        return stopped_line(run_dir, newest)
    have = summary.read(run_dir)
    if have is not None and have.get("final_step") == newest and "params_sha256" in have:
        return complete_line(run_dir, newest)
    note = _rebuild_summary(run_dir, newest)
    return None if note is None else f"{complete_line(run_dir, newest)} ({note})"


def _same_run(run_dir: Path, cfg: Config) -> bool:
    try:
        saved = runview.saved_config(run_dir)
    except ConfigError:
        saved = None
    if saved is None:
        return False  # cannot tell: the worker compares with the checkpoint's own record (and rewrites it)
    now, missing = to_dict(cfg), object()

    def at(tree, key: str):
        for part in key.split("."):
            tree = tree.get(part, missing) if isinstance(tree, dict) else missing
        return tree

    return all(at(saved, k) == at(now, k) for k in SAME_RUN_KEYS)


def _rebuild_summary(run_dir: Path, step: int) -> str | None:
    """summary.json is missing, damaged or older than the final checkpoint: rebuild it from events.jsonl,
    where the worker logged the same figures (run_complete) and the ledger's inputs; of the old file only the
    corpus fingerprint is kept. None when the worker never finished (killed after its final save): it then
    runs again and finishes."""
    done = next(
        (
            e
            for e in events_newest_first(run_dir / rundir.EVENTS)
            if e.get("event") == RUN_COMPLETE and "by" not in e and e.get("step") == step and "params_sha256" in e
        ),
        None,
    )
    if done is None:
        return None
    events = read_events(run_dir / rundir.EVENTS)
    led = goodput.ledger(events, events[0]["time"], events[-1]["time"])
    init = next((e for e in reversed(events) if e["event"] == INIT and "n_params" in e), {})
    try:
        summary.update(
            run_dir,
            keep=("data_fingerprint",),
            final_step=step,
            final_loss=done.get("final_loss"),
            params_sha256=done["params_sha256"],
            **({"n_params": init["n_params"]} if init else {}),
            goodput=led["goodput"],
            restarts=sum(e["event"] == RESTART for e in events),
            recoveries_s=led["recoveries_s"],
            wall_s=led["wall_s"],
        )
    except OSError as e:
        return f"summary.json is damaged and could not be rebuilt: {e.strerror}"
    return "summary.json was damaged or stale: rebuilt from events.jsonl"
