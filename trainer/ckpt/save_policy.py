"""When to save, for both checkpoint tiers: the one owner of the decision. Step and time schedules of the
durable tier (`checkpoint.every_steps`, `every_minutes`, "auto") and of the local one (`local_every_*`),
SIGTERM, the end of the run or of `train.stop_at_step`, and a monitor's "checkpoint now". No jax.

A save is decided in two halves because the processes of a group must save at the same step: `requests`
says what this process's clock asks for (it differs between processes), the loop agrees on it with the
group (trainer.parallel.agree), and `decide` turns the agreed requests into at most one `Save`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from trainer.config import CheckpointConfig
from trainer.store.ckpt_files import DURABLE, LOCAL

# "auto" before this run has measured a save: the blocking seconds assumed for the first interval. Low on
# purpose: a short first interval brings the first measurement, and every save re-derives the interval.
AUTO_PRIOR_BLOCKING_S = 1.0


@dataclass(frozen=True)
class Requests:
    """What this process's clocks ask for; to be agreed with the group before anyone acts on it."""

    durable: bool = False  # checkpoint.every_minutes (or "auto") has passed since the last durable save
    local: bool = False  # checkpoint.local_every_minutes has passed since the last local save


@dataclass(frozen=True)
class Save:
    tier: str  # DURABLE | LOCAL
    reason: str  # preempt | final | stop | periodic | a monitor's reason (checkpoint now) | local


class SavePolicy:
    """`requests()` -> agree -> `decide(step, ...)` -> save -> `saved(save, blocking_s)`. The clock is
    injectable (tests); "auto" re-derives the durable interval from each measured blocking time, the run's
    measured restart cost and the cluster's failure rate (trainer.survival.model)."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        *,
        steps: int,
        stop_at: int,
        devices: int,
        restart_s: float,
        clock: Callable[[], float] = time.time,
    ):
        self._cfg, self._steps, self._stop_at, self._clock = cfg, steps, stop_at, clock
        self._devices, self.restart_s = cfg.auto_devices or devices, restart_s
        self.auto = cfg.every_minutes == "auto"
        self.minutes = self._auto_minutes(AUTO_PRIOR_BLOCKING_S) if self.auto else float(cfg.every_minutes)
        self._last = {DURABLE: clock(), LOCAL: clock()}

    def requests(self, *, local: bool) -> Requests:
        """Time-based requests; `local`: this process has a working local tier."""
        now = self._clock()
        return Requests(
            durable=bool(self.minutes) and now - self._last[DURABLE] >= 60 * self.minutes,
            local=local
            and bool(self._cfg.local_every_minutes)
            and now - self._last[LOCAL] >= 60 * self._cfg.local_every_minutes,
        )

    def decide(self, step: int, *, agreed: Requests, stop: bool, asked: str, hold: bool, local: bool) -> Save | None:
        """The save at `step`, from what the group agreed: `stop` (a SIGTERM anywhere), `asked` (a monitor's
        checkpoint-now reason, "" for none), `hold` (updates frozen while a spike is probed: never save).
        A durable save makes a local one at the same step redundant."""
        if hold:
            return None
        if stop:
            return Save(DURABLE, "preempt")
        if step == self._steps:
            return Save(DURABLE, "final")
        if step == self._stop_at:
            return Save(DURABLE, "stop")
        if asked:
            return Save(DURABLE, asked)
        every = self._cfg.every_steps
        if agreed.durable or (every and step % every == 0):
            return Save(DURABLE, "periodic")
        every = self._cfg.local_every_steps
        if local and (agreed.local or (every and step % every == 0)):
            return Save(LOCAL, "local")
        return None

    def saved(self, save: Save, blocking_s: float) -> float | None:
        """Record a save that started; the new durable interval in minutes when "auto" changed it."""
        self._last[save.tier] = self._clock()
        if save.tier != DURABLE or not self.auto:
            return None
        self.minutes = self._auto_minutes(max(blocking_s, 1e-3))
        return self.minutes

    def _auto_minutes(self, blocking_s: float) -> float:
        from trainer.survival.model import recommend_interval_min

        return recommend_interval_min(
            stall_s=blocking_s, restart_s=self.restart_s, gpus=self._devices, mtbf_hours=self._cfg.mtbf_hours
        )
