"""`python -m trainer status RUN_DIR`: a one-screen health summary of a running or finished run, read from
its files alone (events.jsonl, heartbeat, config.yaml, summary.json). No jax: it answers in a blink and
works on a login node while the run goes on elsewhere. The readers here are shared with the report.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
from pathlib import Path

from trainer.config import Config, ConfigError, load_config
from trainer.observe import goodput, heartbeat, rundir
from trainer.observe.events import iter_events
from trainer.observe.progress import fmt_duration

TERMINAL = {
    "run_complete": "COMPLETE",
    "gave_up": "FAILED",
    "preempted": "PREEMPTED",
    "stopped": "STOPPED",
    "spike_exit": "SPIKE EXIT",
    "runbook_gave_up": "FAILED (the spike runbook gave up)",
}
ATTEMPT_START = ("init", "restore")  # the worker writes one of these once per attempt


@dataclasses.dataclass
class RunView:
    run_dir: Path
    cfg: Config
    events: list[dict]
    heartbeat: dict | None
    summary: dict
    now: float
    problems: list[str] = dataclasses.field(default_factory=list)  # damaged files, shown as notes

    @property
    def steps(self) -> dict[int, dict]:
        """The run's current history, step -> record: a rewind (restart or runbook) drops the steps past
        the point it went back to, and the recomputed steps replace them as they come."""
        out: dict[int, dict] = {}
        for e in self.events:
            if e["event"] == "step":
                while out and next(reversed(out)) >= e["step"]:
                    out.popitem()
                out[e["step"]] = e
        return out


def load(run_dir: str | Path) -> RunView:
    run_dir = Path(run_dir)
    if not (run_dir / "events.jsonl").is_file():
        raise ConfigError(f"{run_dir}: no events.jsonl here; pass a run dir (the run.dir of a run)")
    problems: list[str] = []
    try:
        cfg = load_config(str(run_dir / "config.yaml")) if (run_dir / "config.yaml").is_file() else Config()
    except ConfigError as e:  # another version of the trainer wrote it, or it is damaged: defaults are close enough
        problems.append(f"config.yaml not usable ({e}); showing with default settings")
        cfg = Config()
    summary_path = run_dir / rundir.SUMMARY
    summary = rundir.read_json(summary_path)
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


def num(v) -> float:
    """A metric as a float: events and summary.json are strict JSON, where a NaN or infinite value is null."""
    return math.nan if v is None else float(v)


def fmt_loss(v) -> str:
    return f"{v:.4f}" if v is not None and math.isfinite(v) else "not finite (NaN/Inf)"


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
        if e["event"] in goodput.SESSION_START:
            state, live_pid = "RUNNING", e.get("pid")
        elif e["event"] in ATTEMPT_START or e["event"] == "worker_start":
            state = "RUNNING"
        elif e["event"] in TERMINAL:
            state = TERMINAL[e["event"]] + (f" ({e['reason']})" if e.get("reason") else "")
    if state != "RUNNING":
        return state, False
    pid = live_pid or (v.heartbeat or {}).get("pid")
    return ("RUNNING", True) if _alive(pid) else ("NOT RUNNING (no process; killed or lost)", False)


def overdue_limit(v: RunView, phase: str) -> float:
    return v.cfg.alerts.overdue_fraction * heartbeat.phase_timeout(v.cfg.supervisor, phase)


def open_alerts(events: list[dict]) -> list[dict]:
    """Alerts raised in the current attempt and not cleared since (a restart closes the old ones)."""
    opened: dict[str, dict] = {}
    for e in events:
        if e["event"] in ATTEMPT_START or e["event"] == "worker_start":
            opened = {}
        elif e["event"] == "alert":
            opened[e["kind"]] = e
        elif e["event"] == "alert_cleared":
            opened.pop(e["kind"], None)
    return list(opened.values())


def ledger_now(v: RunView, live: bool) -> dict:
    """The goodput ledger so far; an unsupervised run is one session from its first event."""
    evs = v.events
    if evs and not any(e["event"] in goodput.SESSION_START for e in evs):  # written before session_start existed
        evs = [{"event": "supervisor_start", "time": evs[0]["time"]}, *evs]
    t_end = v.now if live else (evs[-1]["time"] if evs else v.now)
    return goodput.ledger(evs, evs[0]["time"] if evs else v.now, t_end)


def steady_step_s(run_dir: str | Path, *, skip_first: int = 5) -> float:
    """Median step time of the healthy steps: the first `skip_first` of each attempt and checkpoint-blocked
    steps left out. Compare runs with log.health / log.tensorboard on and off to price the dashboard."""
    times, seen = [], 0
    for e in load(run_dir).events:
        if e["event"] in ATTEMPT_START:
            seen = 0
        elif e["event"] == "step":
            seen += 1
            if seen > skip_first and not e.get("ckpt_block_s"):
                times.append(e["step_s"])
    return statistics.median(times) if times else float("nan")


def _median_of(recs: list[dict], key: str) -> float:
    vals = [r[key] for r in recs if r.get(key) is not None]
    return statistics.median(vals) if vals else float("nan")


def _loss_lines(v: RunView, steps: dict[int, dict]) -> list[str]:
    order = [steps[k] for k in sorted(steps)]
    if not order:
        return ["loss      (no step finished yet)"]
    last, n = order[-1], 25
    recent, before = order[-n:], order[-2 * n : -n]
    trend = ""
    if before:
        a, b = statistics.fmean(num(r["loss"]) for r in before), statistics.fmean(num(r["loss"]) for r in recent)
        if math.isfinite(a) and math.isfinite(b):
            trend = (
                f"   trend {'down' if b < a else 'UP'} {abs(b - a) / a:.1%} "
                f"(mean of last {len(recent)} vs the {len(before)} before)"
            )
    lines = [
        f"loss      {fmt_loss(last['loss'])}{trend}",
        f"grad norm {num(last['grad_norm']):.3g} before clipping (median last {len(recent)}: "
        f"{_median_of(recent, 'grad_norm'):.3g}; clip {v.cfg.optim.clip_norm:g})   update norm "
        f"{num(last['update_norm']):.3g}   lr {num(last['lr']):.3g}",
    ]
    recent10 = order[-10:]
    mfu = _median_of(recent10, "mfu")
    mfu_s = f"MFU {mfu:.1%}" if mfu == mfu else "MFU n/a (set log.peak_flops)"
    lines.append(
        f"speed     {_median_of(recent10, 'tokens_per_s'):,.0f} tok/s   {mfu_s}   step "
        f"{_median_of(recent10, 'step_s'):.3f}s (data wait {_median_of(recent10, 'data_wait_s'):.3f}s) "
        f"[median of last {len(recent10)}]"
    )
    return lines


def latest_evals(events: list[dict]) -> dict[int, dict]:
    """step -> the `eval` event of the run's current history (a recomputed step's eval replaces the first)."""
    return {e["step"]: e for e in events if e["event"] == "eval"}


def _eval_line(v: RunView) -> list[str]:
    evals = latest_evals(v.events)
    if not evals:
        return []
    steps = sorted(evals)
    last = evals[steps[-1]]
    line = f"eval      loss {last['loss']:.4f} (perplexity {last['perplexity']:.4g}) at step {steps[-1]}"
    if len(steps) > 1:
        prev = evals[steps[-2]]
        line += f"   {'down' if last['loss'] < prev['loss'] else 'UP'} from {prev['loss']:.4f} at step {steps[-2]}"
    return [line + f"   [held out; {len(steps)} evals]"]


def _progress_line(v: RunView, steps: dict[int, dict], live: bool) -> str:
    total = v.cfg.train.steps
    step = max(steps) if steps else 0
    line = f"step      {step}/{total} ({step / total:.0%})"
    if live and steps and step < total:
        recent = [steps[k] for k in sorted(steps)[-20:]]
        line += f"   ETA {fmt_duration((total - step) * _median_of(recent, 'step_s'))}"
    hb = v.heartbeat
    if hb:
        age = v.now - hb["time"]
        line += f"   heartbeat {age:.1f}s ago (phase {hb['phase']}, step {hb['step']})"
        if live and age > overdue_limit(v, hb["phase"]):
            line += f"  << OVERDUE: no progress for {fmt_duration(age)}"
    return line


def _ops_lines(v: RunView, live: bool) -> list[str]:
    saves = [e for e in v.events if e["event"] == "checkpoint_saved"]
    out = [
        f"ckpt      step {saves[-1]['step']} ({saves[-1].get('reason', '?')}), "
        f"{fmt_duration(v.now - saves[-1]['time'])} ago; {len(saves)} saves"
        if saves
        else "ckpt      none yet"
    ]
    restarts = [e for e in v.events if e["event"] == "restart"]
    why = "; ".join(f"{e.get('reason', '?')} at step {e.get('step')}" for e in restarts[-3:])
    out.append(f"restarts  {len(restarts)}" + (f"  (last: {why})" if restarts else ""))
    actions = [e for e in v.events if e["event"] in ("spike_detected", "rewind", "skip", "soften", "runbook_gave_up")]
    if actions:
        what = ", ".join(f"{e['event']} at step {e.get('step')}" for e in actions[-4:])
        out.append(f"runbook   {sum(e['event'] == 'rewind' for e in actions)} rewinds (last: {what})")
    led = ledger_now(v, live)
    fr = led["goodput"]["fractions"]
    shares = "  ".join(f"{k} {fr[k]:.0%}" for k in goodput.CATEGORIES)
    out.append(f"goodput   {shares}   of {fmt_duration(led['wall_s'])}")
    return out


def _alert_lines(v: RunView, live: bool) -> list[str]:
    alerts = open_alerts(v.events)
    n_all = sum(e["event"] == "alert" for e in v.events)
    out = [f"alerts    {len(alerts)} open, {n_all} raised in total" + (":" if alerts else "")]
    for a in alerts:
        out.append(f"  ! step {a.get('step')} {a['kind']}: {a.get('detail', '')}")
        out.append(f"    runbook: {a.get('runbook', '')}")
    hb = v.heartbeat
    if (
        live
        and hb
        and v.now - hb["time"] > overdue_limit(v, hb["phase"])
        and not any(a["kind"] == "step_overdue" for a in alerts)
    ):
        silent = fmt_duration(v.now - hb["time"])
        out.append(f"  ! step_overdue (from the heartbeat): phase {hb['phase']} silent {silent}")
    return out


def _health_line(v: RunView) -> str:
    last = next((e for e in reversed(v.events) if e["event"] == "health"), None)
    if last is None:
        return "health    no samples (log.health=false or not started)"
    parts = []
    for dev, r in last["devices"].items():
        keys = (
            "temp_c",
            "power_w",
            "mem_used_gb",
            "util_percent",
            "mem_percent",
            "cpu_percent",
            "ecc_corrected",
            "ecc_uncorrected",
            "ecc_injected",
            "xid_count",
            "throttled",
        )
        parts.append(dev + " " + " ".join(f"{k}={r[k]:.3g}" for k in keys if k in r))
    return (
        f"health    (step {last.get('step')}) "
        + "; ".join(parts[:4])
        + (f" (+{len(parts) - 4} more)" if len(parts) > 4 else "")
    )


def render(v: RunView) -> str:
    state, live = run_state(v)
    steps = v.steps
    head = f"run {v.run_dir}   {state}"
    if "params_sha256" in v.summary and not live:
        head += f"   final loss {fmt_loss(v.summary.get('final_loss'))}"
    lines = [
        head,
        _progress_line(v, steps, live),
        *_loss_lines(v, steps),
        *_eval_line(v),
        *_ops_lines(v, live),
        *_alert_lines(v, live),
        _health_line(v),
        *(f"note      {p}" for p in v.problems),
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer status", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", help="the run's run.dir")
    args = p.parse_args(argv)
    try:
        print(render(load(args.run_dir)))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
