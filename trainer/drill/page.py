"""The drill's results for people: the fault table and the checks as text, and a PNG timeline (the loss
against wall time, each fault where it fired, where it was detected and where the run was productive again,
the restarts shaded)."""

from __future__ import annotations

from pathlib import Path

from trainer.store.event_names import HANG_DETECTED, STEP, WORKER_EXIT


def table(rows: list[dict]) -> str:
    head = f"{'#':>3} {'fault':<16} {'step':>6} {'detected by':<19} {'detect s':>9} {'productive s':>13}"
    head += f" {'recomputed':>10} {'downtime s':>10}"
    lines = [head, "-" * len(head)]
    for i, r in enumerate(rows, 1):
        det = r["detected_by"] or "NOT DETECTED"
        ds = f"{r['detect_s']:.1f}" if r["detect_s"] is not None else "-"
        ps = f"{r['productive_s']:.1f}" if r["productive_s"] is not None else ("-" if r["healed"] else "NOT HEALED")
        rec = str(r["recomputed"]) if r["recomputed"] is not None else "-"
        kind = r["kind"] + (f" ({r['hit'].split('/')[0]})" if r.get("hit") else "")
        down = f"{r['downtime_s']:.1f}" if r.get("downtime_s") is not None else "-"
        lines.append(f"{i:>3} {kind:<16} {r['step']:>6} {det:<19} {ds:>9} {ps:>13} {rec:>10} {down:>10}")
    return "\n".join(lines)


def timeline(evs: list[dict], rows: list[dict], path: Path) -> None:
    """`rows`: the drill's faults (checks.faults), each fired at `t` (epoch seconds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(e["time"] for e in evs)
    steps = [e for e in evs if e["event"] == STEP]
    fig, (ax, tl) = plt.subplots(2, 1, figsize=(12, 6), sharex=True, height_ratios=[3, 1])
    ax.plot([e["time"] - t0 for e in steps], [e["loss"] for e in steps], ".", ms=2, color="tab:blue")
    ax.set_ylabel("train loss")
    ax.set_title("fire drill: loss, faults (red), detection (orange), first productive step (green)")
    down = None
    for e in evs:  # restarts: from a worker's exit (or a hang's detection) to the next step
        if (e["event"] == WORKER_EXIT and e.get("exit_code") != 0) or e["event"] == HANG_DETECTED:
            down = e["time"] - t0 if down is None else down
        elif e["event"] == STEP and down is not None:
            for a in (ax, tl):
                a.axvspan(down, e["time"] - t0, color="0.85", lw=0)
            down = None
    for i, r in enumerate(rows):
        fired, kind = r["t"], r["kind"]
        det = fired + r["detect_s"] if r["detect_s"] is not None else None
        prod = fired + r["productive_s"] if r["productive_s"] is not None else None
        y = i % 4
        tl.plot([fired - t0], [y], "x", color="red")
        tl.annotate(kind, (fired - t0, y), fontsize=6, xytext=(2, 3), textcoords="offset points")
        ax.axvline(fired - t0, color="red", lw=0.5, alpha=0.6)
        if det is not None:
            tl.plot([fired - t0, det - t0], [y, y], "-", color="orange")
        if prod is not None:
            tl.plot([prod - t0], [y], "o", color="green", ms=3)
    tl.set_yticks([])
    tl.set_xlabel("seconds since the drilled run started")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
