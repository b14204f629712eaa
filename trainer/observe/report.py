"""`python -m trainer report RUN_DIR`: the end-of-run report in RUN_DIR/report/: PNG plots (loss with
restart/rewind/skip markers, gradient norm, throughput/MFU, goodput breakdown) and report.md.

Written automatically when a run ends (supervisor, or the worker when unsupervised) through
`write_safely`, which never lets a plotting problem fail the run. No jax here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainer.config import ConfigError
from trainer.observe import goodput, runview, status
from trainer.observe.alerts import ALERTS, Kind
from trainer.store import rundir
from trainer.store.event_names import (
    ALERT,
    ALERT_CLEARED,
    ATTEMPT_STARTS,
    CHECKPOINT_NOW,
    CHECKPOINT_SAVED,
    DOWNTIME,
    HANG_DETECTED,
    REPORT_FAILED,
    RESTART,
    RESTORE,
    REWIND,
    RUNBOOK_GAVE_UP,
    SESSION_STARTS,
    SKIP,
    SOFTEN,
    SPIKE_DETECTED,
    STEP,
    STRAGGLER,
)

# event -> (label, colour, line style) of the vertical markers drawn on the series plots
MARKER_STYLE = {
    RESTART: ("restart", "tab:red", "--"),
    HANG_DETECTED: ("hang", "darkred", ":"),
    SPIKE_DETECTED: ("spike", "magenta", "-."),
    REWIND: ("rewind", "tab:purple", "--"),
    SKIP: ("skip", "tab:orange", ":"),
    SOFTEN: ("soften", "tab:brown", "-."),
    RUNBOOK_GAVE_UP: ("runbook gave up", "black", "-"),
    CHECKPOINT_NOW: ("checkpoint now", "black", ":"),
    RESTORE: ("resumed from checkpoint", "tab:green", ":"),
    STRAGGLER: ("straggler", "tab:olive", "-."),
}
GOODPUT_COLOURS = {
    "productive": "tab:green",
    "recompute": "tab:orange",
    "straggler": "tab:brown",
    "checkpoint": "tab:blue",
    "startup": "tab:gray",
    "shutdown": "silver",
    "restart": "tab:red",
}


def _attempts(events: list[dict]) -> list[list[dict]]:
    """Step records split into worker attempts: a restart's recomputed steps draw as their own line."""
    out: list[list[dict]] = []
    for e in events:
        if e["event"] in ATTEMPT_STARTS or not out:
            out.append([])
        if e["event"] == STEP:
            out[-1].append(e)
    return [a for a in out if a]


def _markers(ax, events: list[dict]) -> None:
    seen = set()
    for e in events:
        style = MARKER_STYLE.get(e["event"])
        if style is None or e.get("step") is None:
            continue
        label, colour, ls = style
        ax.axvline(e["step"], color=colour, ls=ls, lw=1.2, alpha=0.8, label=None if label in seen else label)
        seen.add(label)


def _series(ax, attempts: list[list[dict]], key: str, *, label: str, colour: str, log: bool = False) -> int:
    """One line per attempt, the first solid and later ones dashed; returns how many lines it drew. A
    non-finite value (null in the event log) leaves a gap."""
    drawn = 0
    for i, recs in enumerate(attempts):
        pts = [(r["step"], r[key]) for r in recs if r.get(key) is not None and (r[key] > 0 or not log)]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(
                xs,
                ys,
                color=colour,
                lw=1.3,
                alpha=1.0 if i == len(attempts) - 1 else 0.55,
                label=label if drawn == 0 else None,
                ls="-" if drawn == 0 else "--",
            )
            drawn += 1
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    return drawn


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:  # an empty run has nothing to label
        ax.legend(loc="best", fontsize=8)


def _save(fig, plt, out: Path) -> None:
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def _alert_spans(ax, events: list[dict], kind: str, colour: str) -> None:
    start, last_step, labelled = None, 0, False
    for e in events:
        last_step = e.get("step", last_step) if e["event"] == STEP else last_step
        if e["event"] == ALERT and e["kind"] == kind:
            start = e["step"]
        elif start is not None and (e["event"] == ALERT_CLEARED and e["kind"] == kind or e["event"] in ATTEMPT_STARTS):
            ax.axvspan(
                start,
                e.get("step") or last_step,
                color=colour,
                alpha=0.15,
                label=None if labelled else f"alert: {kind}",
            )
            start, labelled = None, True
    if start is not None:
        ax.axvspan(start, last_step, color=colour, alpha=0.15, label=None if labelled else f"alert: {kind} (open)")


def plot_loss(v: runview.RunView, plt, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(9, 4.5))
    drawn = _series(ax, _attempts(v.events), "loss", label="train loss", colour="tab:blue")
    if evals := runview.latest_evals(v.events):
        xs = sorted(evals)
        ax.plot(
            xs, [evals[k]["loss"] for k in xs], "o-", color="tab:orange", lw=1.5, ms=4, label="eval loss (held out)"
        )
    _markers(ax, v.events)
    ax.set_ylabel("loss")
    ax.set_title(f"Loss ({drawn} attempts; dashed = a later attempt's steps)" if drawn > 1 else "Loss")
    _legend(ax)
    _save(fig, plt, out)


def plot_grad_norm(v: runview.RunView, plt, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(9, 4.5))
    attempts = _attempts(v.events)
    _series(ax, attempts, "grad_norm", label="grad norm (before clipping)", colour="tab:red", log=True)
    _series(ax, attempts, "update_norm", label="update norm", colour="tab:green", log=True)
    ax.axhline(v.cfg.optim.clip_norm, color="gray", ls=":", label=f"clip norm {v.cfg.optim.clip_norm:g}")
    _alert_spans(ax, v.events, Kind.GRAD_NORM_RISING, "tab:red")
    _markers(ax, v.events)
    ax.set_ylabel("norm (log scale)")
    ax.set_title("Gradient norm: the leading indicator")
    _legend(ax)
    _save(fig, plt, out)


def plot_throughput(v: runview.RunView, plt, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(9, 4.5))
    attempts = _attempts(v.events)
    rec = next((r for a in attempts for r in a if r.get("mfu") and r["tokens_per_s"]), None)
    _series(ax, attempts, "tokens_per_s", label="tokens/s = MFU (right axis)" if rec else "tokens/s", colour="tab:blue")
    ax.set_ylabel("tokens/s")
    _alert_spans(ax, v.events, Kind.THROUGHPUT_DROP, "tab:orange")
    _markers(ax, v.events)
    saves = sorted({e["step"] for e in v.events if e["event"] == CHECKPOINT_SAVED})
    for i, step in enumerate(saves):
        ax.axvline(step, color="gray", lw=0.8, alpha=0.5, label=None if i else "checkpoint saved")
    if rec:  # MFU is tokens/s times a constant (FLOPs per token / peak): the same line, a second scale
        k = 100 * rec["mfu"] / rec["tokens_per_s"]
        ax.secondary_yaxis("right", functions=(lambda t: t * k, lambda m: m / k)).set_ylabel("MFU % (right axis)")
    _legend(ax)
    title = "Throughput and MFU" if rec else "Throughput"
    ax.set_title(f"{title} (a dip right after a checkpoint mark is save blocking)" if saves else title)
    _save(fig, plt, out)


GOODPUT_ORDER = "largest first"  # the bar's parts are totals over the run, not a timeline: said in plot and text


def goodput_parts(led: dict) -> list[str]:
    """The ledger's categories, largest share first (ties in goodput.CATEGORIES order). Restart downtime and
    checkpoint blocking interleave with the steps, so no drawing order could be the order things happened."""
    secs = led["goodput"]["seconds"]
    return sorted(goodput.CATEGORIES, key=lambda k: -secs[k])


def plot_goodput(led: dict, restarts: int, plt, out: Path, *, resumes: int = 0) -> None:
    secs, fr = led["goodput"]["seconds"], led["goodput"]["fractions"]
    fig, ax = plt.subplots(figsize=(9, 2.8))
    left = 0.0
    for k in goodput_parts(led):
        if secs[k] < 0.05:  # would read "0.0s (0%)": a share the run did not have
            continue
        ax.barh([0], [secs[k]], left=left, color=GOODPUT_COLOURS[k], label=f"{k} {secs[k]:.1f}s ({fr[k]:.0%})")
        if fr[k] >= 0.06:
            ax.text(left + secs[k] / 2, 0, f"{fr[k]:.0%}", ha="center", va="center", color="white", fontsize=9)
        left += secs[k]
    ax.set_yticks([])
    ax.set_xlabel("wall-clock seconds, summed per category")
    what = f"{restarts} restart{'s' if restarts != 1 else ''}" + (
        f", {resumes} resumed session{'s' if resumes != 1 else ''}" if resumes else ""
    )
    ax.set_title(f"Goodput: where the {led['wall_s']:.0f}s went ({what})")
    legend = f"parts {GOODPUT_ORDER} (totals, not a timeline)"
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3, fontsize=8, frameon=False, title=legend)
    _save(fig, plt, out)


def plot_downtime(events: list[dict], plt, out: Path) -> bool:
    """One stacked bar per restart: its downtime part by part, failure to first step (trainer.observe.downtime).
    False (no file) when the run had no restart."""
    downs = [e for e in events if e["event"] == DOWNTIME]
    if not downs:
        return False
    fig, ax = plt.subplots(figsize=(10, 2.0 + 0.4 * len(downs)))
    colours = plt.get_cmap("tab10").colors
    for row, d in enumerate(downs):
        left = 0.0
        for i, (part, secs) in enumerate(d["parts_s"].items()):
            ax.barh([row], [secs], left=left, color=colours[i % 10], label=part if row == 0 else None)
            left += secs
        ax.text(left, row, f" {d['total_s']:.1f}s", va="center", fontsize=8)
    ax.set_yticks(range(len(downs)), [f"step {d.get('step')}: {d.get('reason', '')}"[:32] for d in downs], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the failure to the restarted group's first step")
    ax.set_title("Downtime per restart, part by part")
    ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8, frameon=False)
    _save(fig, plt, out)
    return True


def downtime_table(events: list[dict]) -> list[str]:
    """report.md's downtime section: one row per restart, its parts in seconds."""
    downs = [e for e in events if e["event"] == DOWNTIME]
    if not downs:
        return []
    parts = list(downs[0]["parts_s"])
    return [
        "",
        f"## Downtime per restart ({len(downs)})",
        "",
        "Failure to the restarted group's first step, part by part (seconds; `downtime` events).",
        "",
        "| step | failure | total | " + " | ".join(parts) + " |",
        "|---:|---|---:|" + "---:|" * len(parts),
        *(
            f"| {d.get('step')} | {d.get('reason', '')} | {d['total_s']:.2f} | "
            + " | ".join(f"{d['parts_s'].get(k, 0):.2f}" for k in parts)
            + " |"
            for d in downs
        ),
    ]


def goodput_table(led: dict) -> list[str]:
    """report.md's goodput section, its rows in the bar's order."""
    secs, fr = led["goodput"]["seconds"], led["goodput"]["fractions"]
    return [
        "## Goodput",
        "",
        f"Seconds summed per category over the run, {GOODPUT_ORDER} (as goodput.png draws them; not a timeline).",
        "",
        "| category | seconds | share |",
        "|---|---:|---:|",
        *(f"| {k} | {secs[k]:.1f} | {fr[k]:.1%} |" for k in goodput_parts(led)),
    ]


def _markdown(v: runview.RunView, led: dict, pngs: list[str]) -> str:
    alerts = [e for e in v.events if e["event"] == ALERT]
    lines = [
        "# Run report",
        "",
        f"Run dir: `{v.run_dir}`",
        "",
        "```",
        status.render(v),
        "```",
        "",
        *goodput_table(led),
        *downtime_table(v.events),
    ]
    lines += ["", f"## Alerts ({len(alerts)})", ""]
    if alerts:
        lines += ["| step | alert | detail | runbook |", "|---:|---|---|---|"]
        lines += [
            f"| {a.get('step')} | {a['kind']} | {a.get('detail', '')} | {ALERTS.get(a['kind'], ('', ''))[1]} |"
            for a in alerts
        ]
    else:
        lines.append("None.")
    events = [e for e in v.events if e["event"] in MARKER_STYLE]
    lines += ["", f"## Restarts, resumes and runbook actions ({len(events)})", ""]
    lines += [
        f"- step {e.get('step')}: {MARKER_STYLE[e['event']][0]} {e.get('reason', '')}".rstrip() for e in events
    ] or ["None."]
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in pngs]
    return "\n".join(lines) + "\n"


def write(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Render the plots and report.md; returns the report.md path."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster node
    import matplotlib.pyplot as plt

    v = runview.load(run_dir)
    out = Path(out_dir) if out_dir else v.run_dir / rundir.REPORT
    out.mkdir(parents=True, exist_ok=True)
    _, live = runview.run_state(v)
    led = runview.ledger_now(v, live)
    restarts = sum(e["event"] == RESTART for e in v.events)
    resumes = max(sum(e["event"] in SESSION_STARTS for e in v.events) - 1, 0)
    plot_loss(v, plt, out / "loss.png")
    plot_grad_norm(v, plt, out / "grad_norm.png")
    plot_throughput(v, plt, out / "throughput.png")
    plot_goodput(led, restarts, plt, out / "goodput.png", resumes=resumes)
    pngs = ["loss.png", "grad_norm.png", "throughput.png", "goodput.png"]
    if plot_downtime(v.events, plt, out / "downtime.png"):
        pngs.append("downtime.png")
    md = out / rundir.REPORT_MD
    md.write_text(_markdown(v, led, pngs))
    return md


def write_safely(run_dir: str | Path, log=None) -> Path | None:
    """The end-of-run hook: a report is worth having, never worth failing a finished run for."""
    try:
        return write(run_dir)
    except Exception as e:  # any plotting/IO problem: say so and carry on
        print(f"warning: could not write the run report: {e!r}", file=sys.stderr)
        if log is not None:
            log(REPORT_FAILED, error=repr(e)[:300])
        return None


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer report", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", help="the run's run.dir")
    p.add_argument("--out", help="output folder (default RUN_DIR/report)")
    args = p.parse_args(argv)
    try:
        md = write(args.run_dir, args.out)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {md} and {len(list(md.parent.glob('*.png')))} plots in {md.parent}")
    return 0
