"""Loss-spike detection, the first move of the runbook: a step monitor the worker runs on every step's
metrics. It freezes updates while it probes where a spike ends, then asks the loop to exit SPIKE; the
supervisor's half (rewind, skip, soften, give up) is trainer.supervise.runbook.

Plain Python, no jax: unit tests drive it with synthetic metric streams.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

from trainer.config import RunbookConfig
from trainer.observe.alerts import Do
from trainer.observe.events import events_newest_first
from trainer.store.event_names import SPIKE_DETECTED, STEP


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
        return {
            "mean": mean,
            "std": std,
            "threshold": max(mean + self.sigma * std, mean * (1 + self.min_rise)),
            "onset": max(mean + self.onset_sigma * std, mean * (1 + self.min_rise / 2)),
        }


@dataclasses.dataclass
class _Probe:
    """After a spike the worker keeps reading batches with updates frozen, to see where the bad span ends."""

    fired: dict  # the spike_detected fields: signal, value, threshold, began
    bars: dict  # signal name -> bars frozen at the moment of detection
    end: int  # last offending step so far
    left: int  # probe steps left


class SpikeDetector:
    """A step monitor: returns {"do": Do.HOLD} when a spike starts (the loop freezes updates: LR scale 0, no
    saves) and {"do": Do.SPIKE, began, end, batches, ...} when the offending span is known (the loop exits
    SPIKE). NaN/Inf in loss, grad norm or update norm fires at once, at any step.

    The loss fires on one step; the gradient norm, which is heavy-tailed (lone 3x blips that clipping
    absorbs are normal), must stay above its bar for `grad_sustain` steps. Steps just before a spike whose
    signals were already above the onset bar are part of it: that is where it began, and the gradient
    norm, which moves first, usually marks it.
    """

    def __init__(
        self,
        cfg: RunbookConfig,
        *,
        log: Callable[..., None],
        batch_of: Callable[[int], int],
        stop_step: int,
        events_path: Path | None = None,
    ):
        self.cfg, self.log, self.batch_of, self.stop_step = cfg, log, batch_of, stop_step
        self.events_path = events_path
        self.signals = [
            _Signal("loss", cfg.window, cfg.loss_sigma, cfg.loss_min_rise, cfg.onset_sigma),
            _Signal("grad_norm", cfg.window, cfg.grad_sigma, cfg.grad_min_rise, cfg.onset_sigma),
        ]
        self._onset: int | None = None  # first step of the current run of elevated steps
        self._grad_high = 0  # consecutive steps with the grad norm above its bar
        self._probe: _Probe | None = None
        self._started = False
        self._reported = False  # the spike is reported: the loop is leaving

    def on_step(self, step: int, rec: dict) -> dict | None:
        if not self._started:
            self._started = True
            if self.events_path is not None:  # a restarted worker judges against the history before it
                for r in recent_steps(self.events_path, upto=step - 1, n=self.cfg.window):
                    self._remember(r, self._bars() if len(self.signals[0].hist) >= self.cfg.min_history else None)
        if self._reported:
            # With several processes the group leaves a few steps after the report (the agreement lags); what
            # those steps show is the spike's consequence (after a NaN update every loss is NaN), never a new
            # one: reported, it would move the skip onto innocent batches and keep the offending one.
            return None
        if self._probe is not None:
            return self._probe_step(step, rec)
        bad = [k for k in ("loss", "grad_norm", "update_norm") if k in rec and not math.isfinite(rec[k])]
        if bad:
            return self._fire(
                step, {"signal": f"nonfinite_{bad[0]}", "value": rec[bad[0]], "threshold": None}, bars={}, probe=False
            )
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
        self.log(SPIKE_DETECTED, step=step, **fired)
        self._onset, self._grad_high = None, 0
        if probe and self.cfg.probe_steps and step < self.stop_step:
            self._probe = _Probe(fired, bars, end=step, left=self.cfg.probe_steps)
            return {Do.KEY: Do.HOLD, "reason": fired["signal"]}
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
        self._reported = True
        batches = [self.batch_of(s) for s in range(fired["began"], end + 1)]
        return {Do.KEY: Do.SPIKE, **fired, "end": end, "batches": batches, "open": open_, "probed": probed}


def _fields(signal: str, value: float, bars: dict) -> dict:
    return {
        "signal": signal,
        "value": value,
        "threshold": bars["threshold"],
        "mean": bars["mean"],
        "std": bars["std"],
        "sigma": (value - bars["mean"]) / bars["std"] if bars["std"] else math.inf,
    }


def recent_steps(path: Path, *, upto: int, n: int) -> list[dict]:
    """The last n `step` records at steps <= upto, oldest first. A step logged twice (recomputed after a
    rewind) counts once, by its latest record: that is the trajectory the run continues from."""
    seen: dict[int, dict] = {}
    for e in events_newest_first(path):
        if e.get("event") == STEP and e["step"] <= upto and e["step"] not in seen:
            # events.jsonl is strict JSON: a NaN/Inf metric was written as null
            seen[e["step"]] = {k: math.nan if v is None else v for k, v in e.items()}
            if len(seen) == n:
                break
    return [seen[s] for s in sorted(seen)]
