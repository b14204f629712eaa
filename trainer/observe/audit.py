"""Data audit: each process logs the global sample ids (and the windows they read) of every step, and
`python -m trainer audit RUN_DIR` proves exactly-once consumption per epoch, minus the batches the
runbook skipped, with no overlap between processes and identical data whenever a step is recomputed.

No jax here: the checker runs anywhere. Log format: run_dir/audit/process-<i>.jsonl, one header line
per worker session, then one line per step: {"step", "ids", "windows"}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trainer.store import env_vars, rundir

MAX_PROBLEMS = 20  # a broken pipeline breaks every step; the first few say what is wrong


class AuditLog:
    """Appends this process's consumption; one line per step, flushed, so a killed worker loses nothing
    it had already read."""

    def __init__(
        self,
        run_dir: Path,
        *,
        process: int,
        processes: int,
        start: int,
        global_batch: int,
        epoch_windows: int,
        skips: list[int],
    ):
        d = Path(run_dir) / rundir.AUDIT
        d.mkdir(parents=True, exist_ok=True)
        self._fh = open(d / f"process-{process}.jsonl", "a", buffering=1)
        self._write(
            {
                "header": True,
                "time": time.time(),
                "attempt": int(os.environ.get(env_vars.ATTEMPT, "0")),
                "process": process,
                "processes": processes,
                "start": start,
                "global_batch": global_batch,
                "epoch_windows": epoch_windows,
                "skips": sorted(skips),
            }
        )

    def _write(self, rec: dict) -> None:
        self._fh.write(json.dumps(rec) + "\n")

    def record(self, step: int, batch: dict) -> None:
        self._write({"step": step, "ids": batch["ids"].tolist(), "windows": batch["windows"].tolist()})


@dataclass
class Session:
    """One worker process's life: its header and the steps it read."""

    header: dict
    steps: list[tuple[int, list[int], list[int]]] = field(default_factory=list)


def read_sessions(run_dir: Path) -> list[Session]:
    sessions: list[Session] = []
    for path in sorted((Path(run_dir) / rundir.AUDIT).glob("process-*.jsonl")):
        with open(path) as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except ValueError:  # a line torn by a kill: nothing after it in this session was trained
                    continue
                if rec.get("header"):
                    sessions.append(Session(rec))
                elif sessions:
                    sessions[-1].steps.append((rec["step"], rec["ids"], rec["windows"]))
    # Sessions in start order: a restart's records are compared with what came before them.
    return sorted(sessions, key=lambda s: s.header["time"])


@dataclass
class StepData:
    """The global batch of one step, assembled from the processes' slices (-1 = not seen)."""

    skips: tuple[int, ...]
    ids: np.ndarray
    windows: np.ndarray
    owner: np.ndarray  # process index that read each row


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    rechecked_rows: int = 0
    sessions: int = 0
    process_counts: set[int] = field(default_factory=set)

    def problem(self, msg: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(msg)


def _assemble(sessions: list[Session], rep: Report) -> dict[int, StepData]:
    """Place every process's slice at its rows of the global batch; a recomputed step must read the
    same samples and windows in the same rows (else: a reshuffle or a moved cursor on resume)."""
    batch = sessions[0].header["global_batch"]
    steps: dict[int, StepData] = {}
    for s in sessions:
        h = s.header
        skips = tuple(h["skips"])
        # A rewind that changed the skip list abandons the old branch from its restart step on.
        for k in [k for k, d in steps.items() if k >= h["start"] and d.skips != skips]:
            del steps[k]
        per = batch // h["processes"]
        rows = np.arange(h["process"] * per, (h["process"] + 1) * per)
        for k, ids, windows in s.steps:
            d = steps.setdefault(k, StepData(skips, np.full(batch, -1), np.full(batch, -1), np.full(batch, -1)))
            seen = d.ids[rows] >= 0
            same = (d.ids[rows] == ids) & (d.windows[rows] == windows)
            for i in np.flatnonzero(seen & ~same):
                rep.problem(
                    f"step {k} row {rows[i]}: recomputed with sample {ids[i]} (window {windows[i]}), "
                    f"first read sample {d.ids[rows[i]]} (window {d.windows[rows[i]]}) - data order changed "
                    f"on resume (process {h['process']} of {h['processes']}, session from step {h['start']})"
                )
            rep.rechecked_rows += int(np.sum(seen & same))
            d.ids[rows], d.windows[rows], d.owner[rows] = ids, windows, h["process"]
    return steps


def _check_steps(steps: dict[int, StepData], rep: Report) -> None:
    last = max(steps)
    for k in range(last + 1):
        d = steps.get(k)
        if d is None:
            rep.problem(f"step {k} was never recorded")
            continue
        if (d.ids < 0).any():
            msg = f"step {k}: rows {np.flatnonzero(d.ids < 0).tolist()} never recorded"
            rep.notes.append(msg + " (the run stopped while reading it)") if k == last else rep.problem(msg)
        vals, counts = np.unique(d.ids[d.ids >= 0], return_counts=True)
        for g in vals[counts > 1]:
            who = sorted(set(d.owner[d.ids == g].tolist()))
            rep.problem(
                f"step {k}: sample {g} read more than once in one global batch, by processes {who} (overlapping shards)"
            )


def _check_epochs(
    steps: dict[int, StepData], skips: list[int], batch: int, epoch_windows: int, rep: Report
) -> dict[int, int]:
    """Each sample once, each window once per epoch, and every batch either consumed or skipped."""
    where: dict[int, int] = {}
    seen_window: dict[tuple[int, int], int] = {}
    for k in sorted(steps):
        d = steps[k]
        for g, w in zip(d.ids.tolist(), d.windows.tolist()):
            if g < 0:
                continue
            if g in where and where[g] != k:
                rep.problem(f"sample {g} consumed at steps {where[g]} and {k}")
            where[g] = k
            key = (g // epoch_windows, w)
            if key in seen_window and seen_window[key] != g:
                rep.problem(f"epoch {key[0]}: window {w} read twice (samples {seen_window[key]} and {g})")
            seen_window[key] = g
    consumed = {g // batch for g in where}
    for b in sorted(set(range(max(consumed) + 1)) - consumed - set(skips)):
        rep.problem(
            f"data batch {b} (samples {b * batch}..{b * batch + batch - 1}) was never consumed"
            f" and is not on the skip list"
        )
    for b in sorted(consumed & set(skips)):
        rep.problem(f"data batch {b} is on the skip list but was consumed")
    per_epoch: dict[int, int] = {}
    for g in where:
        per_epoch[g // epoch_windows] = per_epoch.get(g // epoch_windows, 0) + 1
    return per_epoch


def _load(run_dir: Path, rep: Report) -> tuple[list[Session], dict[int, StepData]]:
    sessions = read_sessions(run_dir)
    if not sessions:
        raise FileNotFoundError(f"{run_dir}/audit has no logs (run with --set data.audit=true)")
    steps = _assemble(sessions, rep)
    if not steps:
        raise FileNotFoundError(f"{run_dir}/audit has headers but no steps")
    return sessions, steps


def _compare(steps: dict[int, StepData], other_dir: Path, rep: Report) -> int:
    """Same samples in the same rows at every step both runs took: e.g. after an elastic resume."""
    _, other = _load(other_dir, Report())
    common = sorted(set(steps) & set(other))
    for k in common:
        if not (np.array_equal(steps[k].ids, other[k].ids) and np.array_equal(steps[k].windows, other[k].windows)):
            rep.problem(
                f"step {k}: global batch differs from {other_dir} (ids {steps[k].ids[:4].tolist()}... vs "
                f"{other[k].ids[:4].tolist()}...)"
            )
    return len(common)


def check(run_dir: Path, compare: Path | None = None) -> tuple[Report, dict]:
    """Everything the audit proves, as (report, stats). Raises FileNotFoundError without an audit log."""
    rep = Report()
    sessions, steps = _load(run_dir, rep)
    rep.sessions, rep.process_counts = len(sessions), {s.header["processes"] for s in sessions}
    h0 = sessions[0].header
    for s in sessions:
        for key in ("global_batch", "epoch_windows"):
            if s.header[key] != h0[key]:
                rep.problem(f"{key} changed from {h0[key]} to {s.header[key]} (process {s.header['process']})")
    _check_steps(steps, rep)
    skips = sessions[-1].header["skips"]
    per_epoch = _check_epochs(steps, skips, h0["global_batch"], h0["epoch_windows"], rep)
    stats = {
        "steps": len(steps),
        "last_step": max(steps),
        "global_batch": h0["global_batch"],
        "samples": sum(per_epoch.values()),
        "epoch_windows": h0["epoch_windows"],
        "per_epoch": per_epoch,
        "skips": skips,
        "sessions": rep.sessions,
        "process_counts": sorted(rep.process_counts),
        "rechecked_rows": rep.rechecked_rows,
    }
    if compare is not None:
        stats["compared_steps"] = _compare(steps, compare, rep)
    return rep, stats


def _print(run_dir: Path, rep: Report, st: dict) -> None:
    epochs = ", ".join(f"epoch {e}: {n} of {st['epoch_windows']} windows" for e, n in sorted(st["per_epoch"].items()))
    print(f"audit {'FAILED' if rep.problems else 'ok'}: {run_dir}")
    print(f"  steps 0..{st['last_step']}, global batch {st['global_batch']}, {st['samples']} samples ({epochs})")
    print(
        f"  {st['sessions']} worker sessions; process counts {st['process_counts']}; "
        f"{st['rechecked_rows']} recomputed rows matched their first reading"
    )
    print(f"  skipped batches: {st['skips'] or 'none'}")
    if "compared_steps" in st:
        print(f"  compared with another run's order at {st['compared_steps']} steps")
    for n in rep.notes:
        print(f"  note: {n}")
    for p in rep.problems:
        print(f"  problem: {p}")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer audit", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="a run dir trained with data.audit=true")
    p.add_argument("--json", action="store_true", help="print the stats and problems as JSON")
    p.add_argument(
        "--compare",
        metavar="OTHER_RUN",
        help="also require the same global batch at every step as "
        "this run (e.g. a resume on another process count vs an uninterrupted run)",
    )
    args = p.parse_args(argv)
    try:
        rep, st = check(Path(args.run_dir), Path(args.compare) if args.compare else None)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(dict(st, ok=not rep.problems, problems=rep.problems, notes=rep.notes)))
    else:
        _print(Path(args.run_dir), rep, st)
    return 1 if rep.problems else 0
