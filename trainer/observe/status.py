"""`python -m trainer status RUN_DIR`: a one-screen health summary of a running or finished run, rendered
from what trainer.observe.runview reads of its files. No jax: it answers in a blink and works on a login
node while the run goes on elsewhere.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys

from trainer.config import ConfigError
from trainer.observe import downtime, goodput, health
from trainer.observe.alerts import Kind
from trainer.observe.progress import fmt_duration, fmt_loss
from trainer.observe.runview import RunView, latest_evals, ledger_now, load, open_alerts, overdue_limit, run_state
from trainer.store import rundir
from trainer.store.event_names import ALERT, CHECKPOINT_SAVED, COMPILED, HEALTH, RESTART, REWIND, RUNBOOK_EVENTS


def num(v) -> float:
    """A metric as a float: events and summary.json are strict JSON, where a NaN or infinite value is null."""
    return math.nan if v is None else float(v)


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


def _runtime_line(v: RunView) -> list[str]:
    """What the latest attempt's step ran on: device, attention implementation, XLA flags, memory fraction
    (its `compiled` event; runs from before these were recorded have none)."""
    e = next((e for e in reversed(v.events) if e["event"] == COMPILED and "attention" in e), None)
    if e is None:
        return []
    memory = f", GPU memory fraction {e['gpu_mem_fraction']}" if e.get("gpu_mem_fraction") else ""
    return [
        f"device    {e.get('device_kind')} ({e.get('platform')})   attention {e['attention']}   "
        f"XLA_FLAGS {e.get('xla_flags') or '(none)'}{memory}"
    ]


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
        age = v.now - hb.time
        line += f"   heartbeat {age:.1f}s ago (phase {hb.phase}, step {hb.step})"
        if live and age > overdue_limit(v, hb.phase):
            line += f"  << OVERDUE: no progress for {fmt_duration(age)}"
    return line


def _ops_lines(v: RunView, live: bool) -> list[str]:
    saves = [e for e in v.events if e["event"] == CHECKPOINT_SAVED]
    out = [
        f"ckpt      step {saves[-1]['step']} ({saves[-1].get('reason', '?')}), "
        f"{fmt_duration(v.now - saves[-1]['time'])} ago; {len(saves)} saves"
        if saves
        else "ckpt      none yet"
    ]
    restarts = [e for e in v.events if e["event"] == RESTART]
    why = "; ".join(f"{e.get('reason', '?')} at step {e.get('step')}" for e in restarts[-3:])
    out.append(f"restarts  {len(restarts)}" + (f"  (last: {why})" if restarts else ""))
    if line := downtime.status_line(v.events):
        out.append(line)
    out += _suspect_lines(v)
    actions = [e for e in v.events if e["event"] in RUNBOOK_EVENTS]
    if actions:
        what = ", ".join(f"{e['event']} at step {e.get('step')}" for e in actions[-4:])
        out.append(f"runbook   {sum(e['event'] == REWIND for e in actions)} rewinds (last: {what})")
    led = ledger_now(v, live)
    fr = led["goodput"]["fractions"]
    shares = "  ".join(f"{k} {fr[k]:.0%}" for k in goodput.CATEGORIES)
    out.append(f"goodput   {shares}   of {fmt_duration(led['wall_s'])}")
    return out


def _suspect_lines(v: RunView) -> list[str]:
    """The SLURM nodes the supervisor blamed (RUN_DIR/suspect_nodes.json): later steps and jobs avoid them."""
    nodes = (rundir.read_json(v.run_dir / rundir.SUSPECT_NODES) or {}).get("nodes") or {}
    if not isinstance(nodes, dict) or not nodes:
        return []
    out = [f"suspects  {len(nodes)} node{'s' if len(nodes) > 1 else ''} avoided by later steps:"]
    for name, info in sorted(nodes.items()):
        info = info if isinstance(info, dict) else {}
        job = f", job {info['job']}" if info.get("job") else ""
        out.append(f"  - {name}: {info.get('reason', '?')}{job}")
    return out


def _alert_lines(v: RunView, live: bool) -> list[str]:
    alerts = open_alerts(v.events)
    n_all = sum(e["event"] == ALERT for e in v.events)
    out = [f"alerts    {len(alerts)} open, {n_all} raised in total" + (":" if alerts else "")]
    for a in alerts:
        host = f" on {a['node']} (process {a['process']})" if "process" in a else ""
        out.append(f"  ! step {a.get('step')} {a['kind']}{host}: {a.get('detail', '')}")
        out.append(f"    runbook: {a.get('runbook', '')}")
    hb = v.heartbeat
    if (
        live
        and hb
        and v.now - hb.time > overdue_limit(v, hb.phase)
        and not any(a["kind"] == Kind.STEP_OVERDUE for a in alerts)
    ):
        silent = fmt_duration(v.now - hb.time)
        out.append(f"  ! {Kind.STEP_OVERDUE} (from the heartbeat): phase {hb.phase} silent {silent}")
    return out


def _health_lines(v: RunView) -> list[str]:
    """One line per host: its latest sample, and its ECC errors since its first sample of the run."""
    latest: dict = {}
    first: dict = {}
    for e in v.events:
        if e["event"] == HEALTH:
            latest[e.get("process")] = e
            first.setdefault(e.get("process"), e)
    if not latest:
        return ["health    no samples (log.health=false or not started)"]
    return [_health_line(latest[p], first[p]) for p in sorted(latest, key=lambda p: (p is not None, p))]


def _health_line(last: dict, first: dict) -> str:
    host = f"{last['node']}: " if "node" in last else ""
    ecc = health.ecc_total(last) - health.ecc_total(first)
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
        f"health    {host}(step {last.get('step')}{f', ECC +{ecc:.0f}' if ecc else ''}) "
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
        *_runtime_line(v),
        *_eval_line(v),
        *_ops_lines(v, live),
        *_alert_lines(v, live),
        *_health_lines(v),
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
