"""The loss-spike runbook's escalation, run by the supervisor when the worker exits SPIKE: rewind + skip,
soften if it recurs, give up after a budget; and the state it keeps in RUN_DIR/runbook.json. Detection
is the worker's half: trainer.observe.spikes.

Plain Python, no jax: unit tests drive it with synthetic spikes.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from trainer.config import Config, ConfigError, OptimConfig, RunbookConfig
from trainer.observe import events
from trainer.observe.tensorboard import Writer
from trainer.store import ckpt_files as checkpoint_files
from trainer.store import rundir
from trainer.store.event_names import REWIND, RUNBOOK_GAVE_UP, RUNBOOK_RETRIES, SKIP, SOFTEN, SPIKE_EXIT
from trainer.store.rundir import write_json

GIVE_UP = "give_up"  # the third action, after SKIP and SOFTEN (event_names.RUNBOOK_RETRIES)
ACTION_CODES = {SKIP: 1.0, SOFTEN: 2.0, GIVE_UP: 3.0}  # the runbook/action TensorBoard marker


def retention_pins(steps: Iterable[int], *, window: int | None, pinned: Iterable[int]) -> set[int]:
    """Checkpoints retention must keep: the runbook's rewind target and (window set) the last known good
    one, the newest at least `window` steps older than the newest, plus the oldest younger than that,
    which becomes the last known good one next. So a spike, which is detected within `window` steps of
    where it began, always has a checkpoint from before it to rewind to, whatever keep_latest is."""
    steps = sorted(steps)
    keep = set(pinned)
    if steps and window is not None:
        edge = steps[-1] - window
        keep.update([s for s in steps if s <= edge][-1:] + [s for s in steps if s > edge][:1])
    return keep


@dataclasses.dataclass
class RunbookState:
    """run_dir/runbook.json: part of the run's state, read by every worker start, written only here."""

    skips: list[int]  # data batch indices the run never trains on
    lr_scale: float  # multiplies the whole LR schedule (so its peak)
    clip_norm: float
    b2: float
    pinned: list[int]  # checkpoint steps retention must keep (the rewind target)
    history: list[dict]  # one record per runbook action

    @classmethod
    def load(cls, run_dir: Path, optim: OptimConfig) -> RunbookState:
        p = Path(run_dir) / rundir.RUNBOOK
        saved = _read_state(p) if p.exists() else {}
        return cls(
            skips=saved.get("skips", []),
            lr_scale=saved.get("lr_scale", 1.0),
            clip_norm=saved.get("clip_norm", optim.clip_norm),
            b2=saved.get("b2", optim.b2),
            pinned=saved.get("pinned", []),
            history=saved.get("history", []),
        )

    def save(self, run_dir: Path) -> None:
        # A kill leaves the old state or the new one, never half of each.
        write_json(Path(run_dir) / rundir.RUNBOOK, dataclasses.asdict(self), durable=True)

    def hyperparams(self) -> dict[str, float]:
        """The optimizer's injected hyperparameters, set by the worker after every restore or init."""
        return {"lr_scale": self.lr_scale, "clip_norm": self.clip_norm, "b2": self.b2}


def _read_state(p: Path) -> dict:
    """runbook.json, checked: it decides which data the run trains on, so a damaged one is never guessed at."""
    try:
        saved = json.loads(p.read_bytes())
    except (OSError, ValueError) as e:
        saved, why = None, f"{type(e).__name__}: {e}"
    else:
        why = "not the runbook's JSON object"
    num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    ints = lambda v: isinstance(v, list) and all(isinstance(x, int) for x in v)
    if (
        isinstance(saved, dict)
        and all(num(saved.get(k, 1.0)) for k in ("lr_scale", "clip_norm", "b2"))
        and ints(saved.get("skips", []))
        and ints(saved.get("pinned", []))
        and isinstance(saved.get("history", []), list)
    ):
        return saved
    raise ConfigError(
        f"{p} is damaged ({why[:120]}); it holds the spike runbook's skipped batches and softened "
        f"hyperparameters: restore it from a backup, or move it away to resume without them"
    )


def softened_config(cfg: Config, state: RunbookState) -> Config:
    """The config as the run now trains it: what config.yaml and TensorBoard record."""
    optim = dataclasses.replace(cfg.optim, lr=cfg.optim.lr * state.lr_scale, clip_norm=state.clip_norm, b2=state.b2)
    return dataclasses.replace(cfg, optim=optim)


def decide(history: list[dict], spike: dict, cfg: RunbookConfig) -> str:
    """Skip first (the cheap hypothesis: bad data); soften when a spike comes back within recur_distance
    steps of an earlier skip or soften (then it is the optimizer, not those batches: after a rewind
    and a skip, a spike at the same place is at the same step, on other data); give up when the budget
    is spent."""
    done = [h for h in history if h["action"] in RUNBOOK_RETRIES]
    if len(done) >= cfg.max_actions:
        return GIVE_UP
    if any(abs(spike["began"] - h["began"]) <= cfg.recur_distance for h in done):
        return SOFTEN
    return SKIP


def rewind(run_dir: Path, began: int, tag: int) -> tuple[int, list[int]]:
    """Move every checkpoint at or after the step the spike began out of the way (the supervisor has no
    orbax: a rename is the whole operation); returns the step the run resumes from (0 = init)."""
    ckpts = checkpoint_files.durable_dir(run_dir)
    staged = checkpoint_files.committed_steps(ckpts)
    remote = None
    if url := checkpoint_files.durable_url(run_dir):  # the bucket's steps are the run's; staged copies follow
        from trainer.store import bucket

        remote = bucket.Bucket(url)
        listing = remote.steps()
        steps = sorted(set(listing) | set(staged))
        target = max((s for s in listing if s < began and listing[s]), default=0)
    else:
        steps = staged
        target = max((s for s in steps if s < began), default=0)
    moved = [s for s in steps if s > target]
    for s in moved:
        if s in staged:
            dest = checkpoint_files.rewound_path(run_dir, s, tag)
            dest.parent.mkdir(exist_ok=True)
            os.replace(ckpts / str(s), dest)
        if remote is not None:  # a bucket has no rename: the staged copy (if any) is what stays for a post-mortem
            remote.delete(s)
    return target, moved


def sample_ranges(batches: list[int], global_batch: int) -> list[list[int]]:
    """Inclusive global sample id ranges of the given data batches, contiguous batches merged."""
    out: list[list[int]] = []
    for b in sorted(batches):
        lo, hi = b * global_batch, (b + 1) * global_batch - 1
        if out and out[-1][1] + 1 == lo:
            out[-1][1] = hi
        else:
            out.append([lo, hi])
    return out


def describe(h: dict) -> str:
    what = {
        SKIP: f"skipped batches {_span(h['batches'])}",
        SOFTEN: f"softened: LR scale {h.get('lr_scale')}, clip {h.get('clip_norm')}, b2 {h.get('b2')}",
        GIVE_UP: "gave up",
    }[h["action"]]
    value = f"{h['value']:.4g}" if isinstance(h["value"], float) else h["value"]
    value = "NaN/Inf" if value is None else value  # strict JSON: a non-finite value is stored as null
    bar = f" > {h['threshold']:.4g}" if h.get("threshold") is not None else ""
    return (
        f"#{h['n']} spike at step {h['began']} ({h['signal']} {value}{bar}): rewound {h['from']} -> {h['to']}, {what}"
    )


def _span(batches: list[int]) -> str:
    return f"{batches[0]}-{batches[-1]}" if len(batches) > 1 else str(batches[0]) if batches else "none"


@dataclasses.dataclass
class Outcome:
    action: str  # skip | soften | give_up
    message: str


def respond(run_dir: Path, cfg: Config, write_event: Callable[..., None]) -> Outcome:
    """The supervisor's half, run when the worker exits SPIKE: decide, rewind, record; the supervisor then
    restarts the worker at once (or stops, on give_up)."""
    run_dir = Path(run_dir)
    spike = events.from_last_worker(run_dir / rundir.EVENTS, SPIKE_EXIT)
    if spike is None:
        msg = "runbook: the worker exited SPIKE but wrote no spike_exit event; nothing to act on"
        write_event(RUNBOOK_GAVE_UP, message=msg)
        return Outcome(GIVE_UP, msg)
    state = RunbookState.load(run_dir, cfg.optim)
    n = len(state.history) + 1
    action = decide(state.history, spike, cfg.runbook)
    # Checkpoints move aside before the new state is written: a kill in between leaves the old skips with
    # the old checkpoint, which replays to the same spike, and the runbook simply runs again.
    target, moved = rewind(run_dir, spike["began"], n)
    rc = cfg.runbook
    if action == SKIP:
        state.skips = sorted(set(state.skips) | set(spike["batches"]))
    elif action == SOFTEN:
        state.lr_scale *= rc.lr_factor
        state.clip_norm *= rc.clip_factor
        state.b2 = rc.b2 or state.b2
    state.pinned = [target] if target else []
    rec = {
        "action": action,
        "n": n,
        "from": spike["step"],
        "to": target,
        **{k: spike.get(k) for k in ("began", "end", "signal", "value", "threshold", "batches", "open")},
    }
    if action == SOFTEN:
        rec.update(state.hyperparams(), peak_lr=cfg.optim.lr * state.lr_scale)
    state.history.append(rec)
    state.save(run_dir)
    write_event(REWIND, step=spike["step"], n=n, moved=moved, **{"from": spike["step"], "to": target})
    if action == SKIP:
        write_event(
            SKIP,
            step=rec["began"],
            n=n,
            steps=[rec["began"], rec["end"]],
            batches=rec["batches"],
            samples=sample_ranges(rec["batches"], cfg.data.batch_size),
            skipped_total=len(state.skips),
        )
    elif action == SOFTEN:
        write_event(SOFTEN, step=rec["began"], n=n, **state.hyperparams(), peak_lr=rec["peak_lr"])
    message = f"runbook: {describe(rec)}"
    if action == GIVE_UP:
        tried = [describe(h) for h in state.history[:-1]]
        message = (
            f"runbook gave up after {len(tried)} actions (runbook.max_actions={rc.max_actions}): the spike "
            f"came back at step {rec['began']} ({rec['signal']} {rec['value']}). Tried: {'; '.join(tried)}. "
            f"The run dir is back at the last good checkpoint (step {target}); raise runbook.max_actions "
            f"or lower optim.lr, then rerun to continue."
        )
        write_event(RUNBOOK_GAVE_UP, step=spike["step"], tried=tried, message=message)
    if cfg.log.tensorboard:
        _tensorboard(run_dir / rundir.TENSORBOARD, rec, state, cfg, message)
    return Outcome(action, message)


def _tensorboard(logdir: Path, rec: dict, state: RunbookState, cfg: Config, message: str) -> None:
    w = Writer(logdir, suffix=f".runbook{rec['n']}")
    step = rec["began"]
    w.add(
        step,
        {
            "runbook/action": ACTION_CODES[rec["action"]],
            "runbook/lr_scale": state.lr_scale,
            "runbook/peak_lr": cfg.optim.lr * state.lr_scale,
            "runbook/clip_norm": state.clip_norm,
            "runbook/skipped_batches": len(state.skips),
        },
    )
    w.text("runbook", message, step)
    w.close()
