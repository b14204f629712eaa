"""The progress line: redrawn in place on a terminal, one line a step through a supervisor on a terminal, and
fit for a log file anywhere else (every log.every_steps steps, the attempt's first and last)."""

from __future__ import annotations

import io
import re
import sys

import pytest

from trainer.observe import progress
from trainer.observe.progress import Progress
from trainer.store import env_vars


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _drive(out: io.StringIO, steps: range, *, total: int = 300, every: int = 10, enabled: bool = True) -> str:
    p = Progress(total, enabled, every=every, stream=out)
    for step in steps:
        p.update(step, 2.5, 1234.0, 0.1)
    p.done()
    return out.getvalue()


def _steps(text: str) -> list[int]:
    return [int(m) for m in re.findall(r"step (\d+)/\d+ ", text)]


@pytest.fixture(autouse=True)
def _no_supervisor_terminal(monkeypatch):
    monkeypatch.delenv(env_vars.TERMINAL, raising=False)


def test_off_a_terminal_a_line_every_log_interval_and_the_first_and_last():
    text = _drive(io.StringIO(), range(1, 301))
    assert "\r" not in text and text.count("\n") == 31, text  # not 300
    assert _steps(text) == [1, *range(10, 301, 10)]
    line = text.splitlines()[-1]
    assert line.startswith("[####################] step 300/300  loss 2.5000  1,234 tok/s  ETA 0s"), line
    # A resumed attempt stopped early (train.stop_at_step, a preemption): its first step and its last.
    assert _steps(_drive(io.StringIO(), range(32, 46))) == [32, 40, 45]
    assert _drive(io.StringIO(), range(1, 301), enabled=False) == ""


def test_on_a_terminal_every_step_as_before():
    text = _drive(_Terminal(), range(1, 301))
    assert text.count("\r") == 300 and text.endswith("\n") and text.count("\n") == 1
    assert _steps(text) == list(range(1, 301))


def test_through_a_supervisor_on_a_terminal_a_line_every_step(monkeypatch):
    """The worker's stderr is the supervisor's pipe: the supervisor says whether its own is a terminal."""
    monkeypatch.setattr(sys, "stderr", _Terminal())
    monkeypatch.setenv(env_vars.TERMINAL, progress.env()[env_vars.TERMINAL])
    text = _drive(io.StringIO(), range(1, 301))
    assert text.count("\n") == 300 and "\r" not in text
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # the supervisor's output is a file: so are the workers'
    monkeypatch.setenv(env_vars.TERMINAL, progress.env()[env_vars.TERMINAL])
    assert _drive(io.StringIO(), range(1, 301)).count("\n") == 31
