"""The console progress line (step, loss, tokens/s, ETA) and the duration and loss formats every report shares."""

from __future__ import annotations

import math
import os
import sys
from typing import TextIO

from trainer.store import env_vars


def fmt_duration(s: float) -> str:
    s = max(int(s), 0)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def fmt_loss(v) -> str:
    return f"{v:.4f}" if v is not None and math.isfinite(v) else "not finite (NaN/Inf)"


def env() -> dict[str, str]:
    """What a supervisor tells its workers (their stderr is its pipe): whether its own stderr is a terminal."""
    return {env_vars.TERMINAL: "1" if sys.stderr.isatty() else ""}


class Progress:
    """The progress line: step, loss, tokens/s and ETA. On a terminal it is redrawn in place every step; through
    a supervisor whose stderr is a terminal (env_vars.TERMINAL), one line a step; anywhere else (a log file: a
    SLURM job's output) one line every `every` steps (log.every_steps) and at the first and the last step of the
    attempt, so that a 3-week run at a step a second writes thousands of lines, not millions."""

    def __init__(self, total: int, enabled: bool, *, every: int = 1, stream: TextIO | None = None):
        self._total, self._enabled, self._every = total, enabled, every
        self._out = stream or sys.stderr
        self._tty = self._out.isatty()
        self._each_step = self._tty or os.environ.get(env_vars.TERMINAL) == "1"
        self._written = 0  # lines written off a terminal
        self._unwritten: str | None = None  # off a terminal: the latest line, when not written (done() writes it)

    def update(self, step: int, loss: float, tokens_per_s: float, sec_per_step: float) -> None:
        if not self._enabled:
            return
        eta = max(self._total - step, 0) * sec_per_step
        bar_n = int(20 * step / self._total)
        line = (
            f"[{'#' * bar_n}{'.' * (20 - bar_n)}] step {step}/{self._total}  loss {loss:.4f}  "
            f"{tokens_per_s:,.0f} tok/s  ETA {fmt_duration(eta)}"
        )
        if self._tty:
            print("\r" + line, end="", file=self._out, flush=True)
        elif self._each_step or not self._written or step % self._every == 0 or step >= self._total:
            self._write(line)
        else:
            self._unwritten = line

    def done(self) -> None:
        if self._enabled and self._tty:
            print(file=self._out)
        elif self._unwritten is not None:  # the attempt's last step (stopped early, or the run's end)
            self._write(self._unwritten)

    def _write(self, line: str) -> None:
        print(line, file=self._out, flush=True)
        self._written += 1
        self._unwritten = None
