"""The console progress line (step, loss, tokens/s, ETA) and the duration and loss formats every report shares."""

from __future__ import annotations

import math
import sys


def fmt_duration(s: float) -> str:
    s = max(int(s), 0)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def fmt_loss(v) -> str:
    return f"{v:.4f}" if v is not None and math.isfinite(v) else "not finite (NaN/Inf)"


class Progress:
    """A single console line: step, loss, tokens/s and ETA."""

    def __init__(self, total: int, enabled: bool):
        self._total, self._enabled = total, enabled
        self._tty = sys.stderr.isatty()

    def update(self, step: int, loss: float, tokens_per_s: float, sec_per_step: float) -> None:
        if not self._enabled:
            return
        eta = max(self._total - step, 0) * sec_per_step
        bar_n = int(20 * step / self._total)
        line = (
            f"[{'#' * bar_n}{'.' * (20 - bar_n)}] step {step}/{self._total}  loss {loss:.4f}  "
            f"{tokens_per_s:,.0f} tok/s  ETA {fmt_duration(eta)}"
        )
        print(("\r" + line) if self._tty else line, end="" if self._tty else "\n", file=sys.stderr, flush=True)

    def done(self) -> None:
        if self._enabled and self._tty:
            print(file=sys.stderr)
