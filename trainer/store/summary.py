"""summary.json, a run's final figures: its keys (Summary), its one writer (update) and its one reader (read).
The worker writes what it trained, the supervisor adds the goodput ledger when a session ends, and a re-run
rebuilds it from events.jsonl when it is damaged; all three go through update, so the file has one format.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TypedDict, Unpack

from trainer.store import rundir


class Summary(TypedDict, total=False):
    """Every key of summary.json; the file lists them in the order they were first written."""

    final_step: int  # the step of the final checkpoint
    final_loss: float | None  # that step's loss; None when it was not finite (strict JSON)
    params_sha256: str  # sha256 of the final params (trainer.train.state.params_sha256)
    n_params: int  # the model's parameter count
    data_fingerprint: str  # the prepared corpus trained on (trainer.corpus.shards.fingerprint)
    wall_s: float  # wall seconds of the whole run (the worker's own count until a supervisor's ledger replaces it)
    goodput: dict[str, dict[str, float]]  # the ledger's fractions and seconds per category (trainer.observe.goodput)
    recoveries_s: list[float]  # seconds from each failure to the next step trained
    downtime_s: list[float]  # each restart's downtime, failure to first step (trainer.observe.downtime)
    restarts: int  # the restarts of the run so far


KEYS = frozenset(Summary.__annotations__)


def read(run_dir: str | Path) -> Summary | None:
    """RUN_DIR/summary.json, or None when it is missing or damaged (not a JSON object)."""
    return rundir.read_json(Path(run_dir) / rundir.SUMMARY)


def update(run_dir: str | Path, *, keep: Iterable[str] | None = None, **fields: Unpack[Summary]) -> None:
    """Write `fields` over what summary.json holds, atomically: a key already there keeps its place, a new one
    goes last. `keep` names the only old keys carried over (None: all of them), for writers that start afresh."""
    if unknown := set(fields) - KEYS:
        raise TypeError(f"summary.json has no key {sorted(unknown)}; trainer.store.summary.Summary names its keys")
    keep = None if keep is None else set(keep)
    merged = {k: v for k, v in (read(run_dir) or {}).items() if keep is None or k in keep}
    merged.update(fields)
    rundir.write_json(Path(run_dir) / rundir.SUMMARY, merged)
