"""A run read from its files alone (events.jsonl, heartbeat, config.yaml, summary.json): what it is doing,
its alerts and ledger so far, and its saved config. No jax: `status`, `report`, the checkpoint pickers and
the "already finished" check read a run through here, on a login node while the run goes on elsewhere.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from pathlib import Path

from trainer.config import Config, ConfigError, Phase, from_tree
from trainer.observe import goodput, heartbeat
from trainer.observe.events import iter_events
from trainer.observe.heartbeat import Beat
from trainer.store import rundir
from trainer.store import summary as run_summary
from trainer.store.event_names import (
    ALERT,
    ALERT_CLEARED,
    ATTEMPT_STARTS,
    EVAL,
    RUN_ENDED,
    SESSION_STARTS,
    STEP,
    SUPERVISOR_START,
    WORKER_START,
)
from trainer.yamltree import read_yaml


@dataclasses.dataclass
class RunView:
    run_dir: Path
    cfg: Config
    events: list[dict]
    heartbeat: Beat | None  # process 0's
    summary: dict
    now: float
    problems: list[str] = dataclasses.field(default_factory=list)  # damaged files, shown as notes

    @property
    def steps(self) -> dict[int, dict]:
        """The run's current history, step -> record: a rewind (restart or runbook) drops the steps past
        the point it went back to, and the recomputed steps replace them as they come."""
        out: dict[int, dict] = {}
        for e in self.events:
            if e["event"] == STEP:
                while out and next(reversed(out)) >= e["step"]:
                    out.popitem()
                out[e["step"]] = e
        return out


def load(run_dir: str | Path) -> RunView:
    run_dir = Path(run_dir)
    if not (run_dir / rundir.EVENTS).is_file():
        raise ConfigError(f"{run_dir}: no events.jsonl here; pass a run dir (the run.dir of a run)")
    problems: list[str] = []
    try:
        saved = saved_config(run_dir)
        cfg = Config() if saved is None else from_tree(saved)
    except ConfigError as e:  # another version of the trainer wrote it, or it is damaged: defaults are close enough
        problems.append(f"config.yaml not usable ({e}); showing with default settings")
        cfg = Config()
    summary_path = run_dir / rundir.SUMMARY
    summary = run_summary.read(run_dir)
    if summary is None and summary_path.exists():
        problems.append(f"{summary_path} is damaged (not a JSON object); re-run the training command to rewrite it")
    torn: list[str] = []
    events = list(iter_events(run_dir / rundir.EVENTS, torn))
    if torn:
        problems.append(f"{len(torn)} unreadable line(s) in events.jsonl left out (a write torn by a kill)")
    return RunView(
        run_dir=run_dir,
        cfg=cfg,
        events=events,
        summary=summary or {},
        now=time.time(),
        heartbeat=heartbeat.read(heartbeat.heartbeat_path(run_dir, 0)),
        problems=problems,
    )


def saved_config(run_dir: str | Path) -> dict | None:
    """RUN_DIR/config.yaml as the worker wrote it (the resolved config as trained, a plain tree), or None when
    the run has none yet: the one way a run's saved config is read. A ConfigError when it cannot be read or is
    not a YAML mapping (damaged, or not ours)."""
    path = Path(run_dir) / rundir.CONFIG
    return read_yaml(str(path)) if path.is_file() else None


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def run_state(v: RunView) -> tuple[str, bool]:
    """(what the run is doing, whether it is live). A terminal event counts only if nothing started after it."""
    state, live_pid = "NOT STARTED", None
    for e in v.events:
        if e["event"] in SESSION_STARTS:
            state, live_pid = "RUNNING", e.get("pid")
        elif e["event"] in (*ATTEMPT_STARTS, WORKER_START):
            state = "RUNNING"
        elif e["event"] in RUN_ENDED:
            state = RUN_ENDED[e["event"]] + (f" ({e['reason']})" if e.get("reason") else "")
    if state != "RUNNING":
        return state, False
    pid = live_pid or (v.heartbeat.pid if v.heartbeat else None)
    return ("RUNNING", True) if _alive(pid) else ("NOT RUNNING (no process; killed or lost)", False)


def overdue_limit(v: RunView, phase: Phase) -> float:
    return v.cfg.alerts.overdue_fraction * phase.timeout(v.cfg.supervisor)


def open_alerts(events: list[dict]) -> list[dict]:
    """Alerts raised in the current attempt and not cleared since (a restart closes the old ones); a host's
    hardware alert is its own (its "process")."""
    opened: dict[tuple, dict] = {}
    for e in events:
        if e["event"] in (*ATTEMPT_STARTS, WORKER_START):
            opened = {}
        elif e["event"] == ALERT:
            opened[e["kind"], e.get("process")] = e
        elif e["event"] == ALERT_CLEARED:
            opened.pop((e["kind"], e.get("process")), None)
    return list(opened.values())


def ledger_now(v: RunView, live: bool) -> dict:
    """The goodput ledger so far; an unsupervised run is one session from its first event."""
    evs = v.events
    if evs and not any(e["event"] in SESSION_STARTS for e in evs):  # written before session_start existed
        evs = [{"event": SUPERVISOR_START, "time": evs[0]["time"]}, *evs]
    t_end = v.now if live else (evs[-1]["time"] if evs else v.now)
    return goodput.ledger(evs, evs[0]["time"] if evs else v.now, t_end)


def steady_step_s(run_dir: str | Path, *, skip_first: int = 5) -> float:
    """Median step time of the healthy steps: the first `skip_first` of each attempt and checkpoint-blocked
    steps left out. Compare runs with log.health / log.tensorboard on and off to price the dashboard."""
    times, seen = [], 0
    for e in load(run_dir).events:
        if e["event"] in ATTEMPT_STARTS:
            seen = 0
        elif e["event"] == STEP:
            seen += 1
            if seen > skip_first and not e.get("ckpt_block_s"):
                times.append(e["step_s"])
    return statistics.median(times) if times else float("nan")


def latest_evals(events: list[dict]) -> dict[int, dict]:
    """step -> the `eval` event of the run's current history (a recomputed step's eval replaces the first)."""
    return {e["step"]: e for e in events if e["event"] == EVAL}
