"""The loss-spike runbook: the detector the worker runs on every step's metrics, and the escalation the
supervisor runs when the worker exits SPIKE (rewind + skip, soften if it recurs, give up after a budget).

Plain Python, no jax: the supervisor imports this, and unit tests drive it with synthetic metric streams.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from trainer import goodput
from trainer.config import Config, OptimConfig, RunbookConfig

STATE_FILE = "runbook.json"
ACTION_CODES = {"skip": 1.0, "soften": 2.0, "give_up": 3.0}  # the runbook/action TensorBoard marker


# --- detection (worker side) ----------------------------------------------------------------------
class _Signal:
    """One metric's rolling window: mean, std and the bars a value is judged against."""

    def __init__(self, name: str, window: int, sigma: float, min_rise: float, onset_sigma: float):
        self.name, self.sigma, self.min_rise, self.onset_sigma = name, sigma, min_rise, onset_sigma
        self.hist: collections.deque[float] = collections.deque(maxlen=window)

    def bars(self) -> dict:
        n = len(self.hist)
        mean = sum(self.hist) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in self.hist) / n)
        # The relative floor keeps a near-constant window (tiny std) from turning noise into spikes.
        return {"mean": mean, "std": std, "threshold": max(mean + self.sigma * std, mean * (1 + self.min_rise)),
                "onset": max(mean + self.onset_sigma * std, mean * (1 + self.min_rise / 2))}


@dataclasses.dataclass
class _Probe:
    """After a spike the worker keeps reading batches with updates frozen, to see where the bad span ends."""

    fired: dict  # the spike_detected fields: signal, value, threshold, began
    bars: dict  # signal name -> bars frozen at the moment of detection
    end: int  # last offending step so far
    left: int  # probe steps left


class SpikeDetector:
    """A step monitor: returns {"do": "hold"} when a spike starts (the loop freezes updates: LR scale 0, no
    saves) and {"do": "spike", began, end, batches, ...} when the offending span is known (the loop exits
    SPIKE). NaN/Inf in loss, grad norm or update norm fires at once, at any step.

    The loss fires on one step; the gradient norm, which is heavy-tailed (lone 3x blips that clipping
    absorbs are normal), must stay above its bar for `grad_sustain` steps. Steps just before a spike whose
    signals were already above the onset bar are part of it: that is where it began, and the gradient
    norm, which moves first, usually marks it.
    """

    def __init__(self, cfg: RunbookConfig, *, log: Callable[..., None], batch_of: Callable[[int], int],
                 stop_step: int, events_path: Path | None = None):
        self.cfg, self.log, self.batch_of, self.stop_step = cfg, log, batch_of, stop_step
        self.events_path = events_path
        self.signals = [_Signal("loss", cfg.window, cfg.loss_sigma, cfg.loss_min_rise, cfg.onset_sigma),
                        _Signal("grad_norm", cfg.window, cfg.grad_sigma, cfg.grad_min_rise, cfg.onset_sigma)]
        self._onset: int | None = None  # first step of the current run of elevated steps
        self._grad_high = 0  # consecutive steps with the grad norm above its bar
        self._probe: _Probe | None = None
        self._started = False

    def on_step(self, step: int, rec: dict) -> dict | None:
        if not self._started:
            self._started = True
            if self.events_path is not None:  # a restarted worker judges against the history before it
                for r in recent_steps(self.events_path, upto=step - 1, n=self.cfg.window):
                    self._remember(r, self._bars() if len(self.signals[0].hist) >= self.cfg.min_history else None)
        if self._probe is not None:
            return self._probe_step(step, rec)
        bad = [k for k in ("loss", "grad_norm", "update_norm") if k in rec and not math.isfinite(rec[k])]
        if bad:
            return self._fire(step, {"signal": f"nonfinite_{bad[0]}", "value": rec[bad[0]], "threshold": None},
                              bars={}, probe=False)
        bars = None
        if step >= self.cfg.warmup_steps and len(self.signals[0].hist) >= self.cfg.min_history:
            bars = self._bars()
            fired = self._judge(rec, bars)
            if fired:
                return self._fire(step, fired, bars=bars, probe=True)
            elevated = any(rec[s.name] > bars[s.name]["onset"] for s in self.signals)
            self._onset = (step if self._onset is None else self._onset) if elevated else None
        self._remember(rec, bars)
        return None

    def _bars(self) -> dict:
        return {s.name: s.bars() for s in self.signals}

    def _remember(self, rec: dict, bars: dict | None) -> None:
        for s in self.signals:
            # Values above the spike bar (a grad-norm blip that did not fire) stay out of the statistics:
            # one outlier would widen the bar enough to hide the next. NaN would blind them for good.
            v = float(rec[s.name])
            if math.isfinite(v) and (bars is None or v <= bars[s.name]["threshold"]):
                s.hist.append(v)

    def _judge(self, rec: dict, bars: dict) -> dict | None:
        loss, gn = bars["loss"], bars["grad_norm"]
        self._grad_high = self._grad_high + 1 if rec["grad_norm"] > gn["threshold"] else 0
        if rec["loss"] > loss["threshold"]:
            return _fields("loss", rec["loss"], loss)
        if self._grad_high >= self.cfg.grad_sustain:
            return _fields("grad_norm", rec["grad_norm"], gn)
        return None

    def _fire(self, step: int, fired: dict, *, bars: dict, probe: bool) -> dict:
        # Elevated steps right before this one belong to the spike; never reach back past the window.
        began = max(self._onset if self._onset is not None else step, step - self.cfg.window + 1)
        fired = dict(fired, began=began)
        self.log("spike_detected", step=step, **fired)
        self._onset, self._grad_high = None, 0
        if probe and self.cfg.probe_steps and step < self.stop_step:
            self._probe = _Probe(fired, bars, end=step, left=self.cfg.probe_steps)
            return {"do": "hold", "reason": fired["signal"]}
        return self._spike(fired, end=step, open_=False, probed=0)

    def _probe_step(self, step: int, rec: dict) -> dict | None:
        p = self._probe
        if not all(math.isfinite(rec[k]) for k in ("loss", "grad_norm")):
            return self._finish(step, open_=False)  # the frozen model blew up: the span seen so far stands
        offending = any(rec[s.name] > p.bars[s.name]["threshold"] for s in self.signals)
        if not offending:
            return self._finish(step, open_=False)
        p.end, p.left = step, p.left - 1
        if p.left == 0 or step >= self.stop_step:
            return self._finish(step, open_=True)  # still bad: the runbook may have to skip more
        return None

    def _finish(self, step: int, *, open_: bool) -> dict:
        p, self._probe = self._probe, None
        return self._spike(p.fired, end=p.end, open_=open_, probed=step - p.fired["began"])

    def _spike(self, fired: dict, *, end: int, open_: bool, probed: int) -> dict:
        batches = [self.batch_of(s) for s in range(fired["began"], end + 1)]
        return {"do": "spike", **fired, "end": end, "batches": batches, "open": open_, "probed": probed}


def _fields(signal: str, value: float, bars: dict) -> dict:
    return {"signal": signal, "value": value, "threshold": bars["threshold"], "mean": bars["mean"],
            "std": bars["std"], "sigma": (value - bars["mean"]) / bars["std"] if bars["std"] else math.inf}


def recent_steps(path: Path, *, upto: int, n: int) -> list[dict]:
    """The last n `step` records at steps <= upto, oldest first. A step logged twice (recomputed after a
    rewind) counts once, by its latest record: that is the trajectory the run continues from."""
    seen: dict[int, dict] = {}
    for e in goodput.events_newest_first(path):
        if e.get("event") == "step" and e["step"] <= upto and e["step"] not in seen:
            seen[e["step"]] = e
            if len(seen) == n:
                break
    return [seen[s] for s in sorted(seen)]


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


# --- escalation (supervisor side) -----------------------------------------------------------------
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
        p = Path(run_dir) / STATE_FILE
        saved = json.loads(p.read_text()) if p.is_file() else {}
        return cls(skips=saved.get("skips", []), lr_scale=saved.get("lr_scale", 1.0),
                   clip_norm=saved.get("clip_norm", optim.clip_norm), b2=saved.get("b2", optim.b2),
                   pinned=saved.get("pinned", []), history=saved.get("history", []))

    def save(self, run_dir: Path) -> None:
        p = Path(run_dir) / STATE_FILE
        tmp = p.with_suffix(".tmp")
        with open(tmp, "w") as fh:
            json.dump(dataclasses.asdict(self), fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)  # a kill leaves the old state or the new one, never half of each

    def hyperparams(self) -> dict[str, float]:
        """The optimizer's injected hyperparameters, set by the worker after every restore or init."""
        return {"lr_scale": self.lr_scale, "clip_norm": self.clip_norm, "b2": self.b2}


def softened_config(cfg: Config, state: RunbookState) -> Config:
    """The config as the run now trains it: what config.yaml and TensorBoard record."""
    optim = dataclasses.replace(cfg.optim, lr=cfg.optim.lr * state.lr_scale, clip_norm=state.clip_norm, b2=state.b2)
    return dataclasses.replace(cfg, optim=optim)


def decide(history: list[dict], spike: dict, cfg: RunbookConfig) -> str:
    """Skip first (the cheap hypothesis: bad data); soften when a spike comes back within recur_distance
    steps of an earlier skip or soften (then it is the optimizer, not those batches: after a rewind
    and a skip, a spike at the same place is at the same step, on other data); give up when the budget
    is spent."""
    done = [h for h in history if h["action"] in ("skip", "soften")]
    if len(done) >= cfg.max_actions:
        return "give_up"
    if any(abs(spike["began"] - h["began"]) <= cfg.recur_distance for h in done):
        return "soften"
    return "skip"


def last_spike(events_path: Path) -> dict | None:
    """The spike_exit event of the worker that just exited (None if it wrote none)."""
    for e in goodput.events_newest_first(events_path):
        if e.get("event") == "spike_exit":
            return e
        if e.get("event") == "worker_start":
            return None
    return None


def rewind(run_dir: Path, began: int, tag: int) -> tuple[int, list[int]]:
    """Move every checkpoint at or after the step the spike began out of the way (the supervisor has no
    orbax: a rename is the whole operation); returns the step the run resumes from (0 = init)."""
    ckpts = Path(run_dir) / "checkpoints"
    steps = sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) if ckpts.is_dir() else []
    target = max((s for s in steps if s < began), default=0)
    moved = [s for s in steps if s > target]
    if moved:
        aside = Path(run_dir) / "rewound"
        aside.mkdir(exist_ok=True)
        for s in moved:
            os.replace(ckpts / str(s), aside / f"{s}-{tag}")
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
    what = {"skip": f"skipped batches {_span(h['batches'])}",
            "soften": f"softened: LR scale {h.get('lr_scale')}, clip {h.get('clip_norm')}, b2 {h.get('b2')}",
            "give_up": "gave up"}[h["action"]]
    value = f"{h['value']:.4g}" if isinstance(h["value"], float) else h["value"]
    bar = f" > {h['threshold']:.4g}" if h.get("threshold") is not None else ""
    return (f"#{h['n']} spike at step {h['began']} ({h['signal']} {value}{bar}): "
            f"rewound {h['from']} -> {h['to']}, {what}")


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
    spike = last_spike(run_dir / "events.jsonl")
    if spike is None:
        msg = "runbook: the worker exited SPIKE but wrote no spike_exit event; nothing to act on"
        write_event("runbook_gave_up", message=msg)
        return Outcome("give_up", msg)
    state = RunbookState.load(run_dir, cfg.optim)
    n = len(state.history) + 1
    action = decide(state.history, spike, cfg.runbook)
    # Checkpoints move aside before the new state is written: a kill in between leaves the old skips with
    # the old checkpoint, which replays to the same spike, and the runbook simply runs again.
    target, moved = rewind(run_dir, spike["began"], n)
    rc = cfg.runbook
    if action == "skip":
        state.skips = sorted(set(state.skips) | set(spike["batches"]))
    elif action == "soften":
        state.lr_scale *= rc.lr_factor
        state.clip_norm *= rc.clip_factor
        state.b2 = rc.b2 or state.b2
    state.pinned = [target] if target else []
    rec = {"action": action, "n": n, "from": spike["step"], "to": target,
           **{k: spike.get(k) for k in ("began", "end", "signal", "value", "threshold", "batches", "open")}}
    if action == "soften":
        rec.update(state.hyperparams(), peak_lr=cfg.optim.lr * state.lr_scale)
    state.history.append(rec)
    state.save(run_dir)
    write_event("rewind", step=spike["step"], n=n, moved=moved, **{"from": spike["step"], "to": target})
    if action == "skip":
        write_event("skip", step=rec["began"], n=n, steps=[rec["began"], rec["end"]], batches=rec["batches"],
                    samples=sample_ranges(rec["batches"], cfg.data.batch_size), skipped_total=len(state.skips))
    elif action == "soften":
        write_event("soften", step=rec["began"], n=n, **state.hyperparams(), peak_lr=rec["peak_lr"])
    message = f"runbook: {describe(rec)}"
    if action == "give_up":
        tried = [describe(h) for h in state.history[:-1]]
        message = (f"runbook gave up after {len(tried)} actions (runbook.max_actions={rc.max_actions}): the spike "
                   f"came back at step {rec['began']} ({rec['signal']} {rec['value']}). Tried: {'; '.join(tried)}. "
                   f"The run dir is back at the last good checkpoint (step {target}); raise runbook.max_actions "
                   f"or lower optim.lr, then rerun to continue.")
        write_event("runbook_gave_up", step=spike["step"], tried=tried, message=message)
    if cfg.log.tensorboard:
        _tensorboard(run_dir / "tb", rec, state, cfg, message)
    return Outcome(action, message)


def _tensorboard(logdir: Path, rec: dict, state: RunbookState, cfg: Config, message: str) -> None:
    from tensorboardX import SummaryWriter  # local: only runs that spike pay for the import

    # Its own file name suffix: another writer opened in the same second (the supervisor's goodput ledger
    # right after a give-up) would otherwise truncate this file.
    w = SummaryWriter(str(logdir), filename_suffix=f".runbook{rec['n']}")
    step = rec["began"]
    w.add_scalar("runbook/action", ACTION_CODES[rec["action"]], step)
    w.add_scalar("runbook/lr_scale", state.lr_scale, step)
    w.add_scalar("runbook/peak_lr", cfg.optim.lr * state.lr_scale, step)
    w.add_scalar("runbook/clip_norm", state.clip_norm, step)
    w.add_scalar("runbook/skipped_batches", len(state.skips), step)
    w.add_text("runbook", message, step)
    w.close()
