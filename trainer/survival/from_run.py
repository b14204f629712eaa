"""Reads the measured checkpoint stall, restart downtime and healthy MFU of a trainer run dir (`survival --from-run`).

Stdlib only (plus the run's event and summary readers): the checkpoint policy reaches the survival model, which must
stay import-light.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainer.observe.events import iter_events
from trainer.store import rundir, summary
from trainer.store.event_names import CHECKPOINT_SAVED, DOWNTIME, STEP


def _nonneg(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _events(path: Path, notes: list[str]) -> Iterator[dict[str, Any]]:
    if not path.is_file():
        notes.append(f"no {path.name}")
        return
    bad: list[str] = []
    yield from (ev for ev in iter_events(path, bad) if isinstance(ev, dict))
    if bad:
        notes.append(f"skipped {len(bad)} unreadable lines in {path.name}")


def _restart_from_summary(run_dir: Path) -> tuple[float | None, str]:
    name = rundir.SUMMARY
    try:
        s = summary.read(run_dir)  # None when missing or damaged: a TypeError below
        seconds = s["goodput"]["seconds"]["restart"]
        restarts = s["restarts"]
    except (KeyError, TypeError):
        return None, f"no usable goodput.seconds.restart / restarts in {name}"
    if not (_nonneg(seconds) and _nonneg(restarts)) or restarts <= 0:
        return None, f"{name} records no restarts"
    return seconds / restarts, f"restart: {seconds:.0f} s over {restarts} restarts in {name}"


def load_run(run_dir: Path) -> tuple[dict[str, float], list[str]]:
    """Measured stall_s / restart_s / mfu from RUN_DIR; pieces that are absent are left out and noted."""
    found: dict[str, float] = {}
    notes: list[str] = []
    blocking: list[float] = []
    mfus: list[float] = []
    downs: list[float] = []  # each restart's downtime, failure to first step (trainer.observe.downtime)
    causal = False  # the run logged `mfu_full_attn` beside `mfu`: its mfu counts attention's causal half
    for ev in _events(run_dir / rundir.EVENTS, notes):
        if ev.get("event") == DOWNTIME and _nonneg(ev.get("total_s")):
            downs.append(float(ev["total_s"]))
        elif ev.get("event") == CHECKPOINT_SAVED and _nonneg(ev.get("blocking_s")):
            blocking.append(float(ev["blocking_s"]))
        elif ev.get("event") == STEP and _nonneg(ev.get("mfu")) and 0 < ev["mfu"] <= 1:
            mfus.append(float(ev["mfu"]))
            causal = causal or "mfu_full_attn" in ev
    # Medians: the first save and the steps after a restart include compilation and warm-up.
    if blocking:
        found["stall_s"] = statistics.median(blocking)
        notes.append(f"stall: median blocking_s of {len(blocking)} checkpoint_saved events")
    if mfus:
        found["mfu"] = statistics.median(mfus)
        notes.append(
            f"mfu: median of {len(mfus)} step events"
            + ("" if causal else " (logged before issue 47: it counts the whole L x L attention, not the causal half)")
        )
    restart_s, note = _restart_from_summary(run_dir)
    if downs:  # measured failure by failure, the time before the supervisor knew included
        restart_s, note = statistics.median(downs), f"restart: median downtime of {len(downs)} downtime events"
    if restart_s is not None:
        found["restart_s"] = restart_s
    notes.append(note)
    return found, notes
