"""`python -m trainer status` and `python -m trainer report` on a real supervised run, while it is going
(after a crash and restart) and after it finished; the report is also written automatically at the end."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import matplotlib.image
import pytest
from conftest import ROOT, child_env, events, step_losses, trainer_cmd
from test_first_hour import _figures

from trainer.observe import goodput, report, runview
from trainer.store import event_names as E

PNGS = ("loss.png", "grad_norm.png", "throughput.png", "goodput.png")
# The worker kills itself with SIGUSR2 at step 12 (the `signal` fault; restart from the step-10 checkpoint),
# then slow steps keep the run observable.
RUN = [
    "train.steps=36",
    "log.report=true",
    "faults=[{kind: signal, step: 12, signal: SIGUSR2}, {kind: slow, step: 16, seconds: 0.25, count: 20}]",
]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer", *args], cwd=ROOT, capture_output=True, text=True, timeout=120, env=child_env()
    )


def _steps_after_restart(run: Path) -> int:
    """The newest step of the second attempt (it restores from step 10, or starts over when the step-10
    save was still in flight at the crash)."""
    try:
        lines = (run / "events.jsonl").read_text().splitlines()
    except OSError:
        return 0
    evs = [json.loads(x) for x in lines if x.strip().endswith("}")]
    starts = [i for i, e in enumerate(evs) if e["event"] in E.ATTEMPT_STARTS]
    if len(starts) < 2:
        return 0
    return max((e["step"] for e in evs[starts[-1] :] if e["event"] == E.STEP), default=0)


def _check_pngs(folder: Path) -> None:
    for name in PNGS:
        img = matplotlib.image.imread(folder / name)
        assert img.shape[0] > 200 and img.shape[1] > 600, (name, img.shape)


@pytest.mark.slow
def test_status_and_report_while_running_and_after_restarts(tmp_path, monkeypatch):
    run = tmp_path / "run"
    log = open(tmp_path / "run.log", "w")
    proc = subprocess.Popen(trainer_cmd(run, *RUN), cwd=ROOT, env=child_env(), stdout=log, stderr=log)
    try:
        deadline = time.time() + 300
        while _steps_after_restart(run) < 18:
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "run.log").read_text()[-3000:]
            time.sleep(0.2)
        live = _cli("status", str(run))
        assert live.returncode == 0, live.stderr
        out = live.stdout
        assert "RUNNING" in out and "restarts  1" in out and "/36 (" in out and "ETA" in out, out
        for word in ("loss", "grad norm", "tok/s", "MFU", "ckpt      step", "goodput", "alerts", "health"):
            assert word in out, (word, out)
        assert _cli("report", str(run), "--out", str(tmp_path / "live")).returncode == 0
        _check_pngs(tmp_path / "live")
        assert "RUNNING" in (tmp_path / "live" / "report.md").read_text()
        assert proc.wait(timeout=300) == 0, (tmp_path / "run.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    done = _cli("status", str(run)).stdout
    assert "COMPLETE" in done and "36/36 (100%)" in done and "restarts  1" in done and "ETA" not in done, done
    # Written by the supervisor at the end, without being asked.
    _check_pngs(run / "report")
    md = (run / "report" / "report.md").read_text()
    assert "COMPLETE" in md and "restart" in md and "![loss.png](loss.png)" in md
    assert runview.steady_step_s(run) > 0
    (died,) = [e for e in events(run) if e["event"] == E.WORKER_EXIT and e.get("signal")]
    assert died["signal"] == "SIGUSR2" and died["step"] == 12, died  # the signal the fault names
    _report_shows_the_run(run, monkeypatch)


def _report_shows_the_run(run: Path, monkeypatch) -> None:
    """What the PNGs draw, read from the figures the report saves: every attempt's losses (the restarted
    one dashed), the restart marker at its step, and the goodput bars at the ledger's seconds."""
    figs = _figures(run, monkeypatch)
    (ax,) = figs["loss.png"].axes
    series = [ln for ln in ax.get_lines() if ln.get_color() == "tab:blue"]
    by_attempt: list[dict] = []  # step -> loss, per worker attempt (each begins with init or restore)
    for e in events(run):
        if e["event"] in E.ATTEMPT_STARTS:
            by_attempt.append({})
        elif e["event"] == E.STEP:
            by_attempt[-1][e["step"]] = e["loss"]
    assert len(by_attempt) == 2 and [ln.get_linestyle() for ln in series] == ["-", "--"], series
    for line, want in zip(series, by_attempt):
        assert dict(zip(line.get_xdata(), line.get_ydata())) == want
    assert sorted({k for a in by_attempt for k in a}) == sorted(step_losses(run)) == list(range(1, 37))
    restarts = [ln.get_xdata()[0] for ln in ax.get_lines() if ln.get_label() == "restart"]
    assert restarts == [12], [(ln.get_label(), ln.get_xdata()) for ln in ax.get_lines()]
    (ax,) = figs["goodput.png"].axes
    ledger = runview.ledger_now(runview.load(run), False)
    led = ledger["goodput"]["seconds"]
    bars = [round(p.get_width(), 6) for p in ax.patches]
    assert bars == [round(led[k], 6) for k in report.goodput_parts(ledger) if led[k] >= 0.05], (bars, led)
    assert ax.get_title().endswith("(1 restart)") and led["restart"] > 0 and led["recompute"] > 0
    # The restart's downtime, part by part: one bar, its segments the event's parts, in `status` and report.md.
    (down,) = [e for e in events(run) if e["event"] == E.DOWNTIME]
    (ax,) = figs["downtime.png"].axes
    assert [round(p.get_width(), 6) for p in ax.patches] == [round(v, 6) for v in down["parts_s"].values()]
    assert f"downtime  last {down['total_s']:.1f}s (signal SIGUSR2" in _cli("status", str(run)).stdout
    assert f"| {down['step']} | signal SIGUSR2 | {down['total_s']:.2f} |" in (run / "report" / "report.md").read_text()


def test_the_goodput_ledger_puts_known_seconds_in_each_category():
    """A synthetic history with known seconds: a first session (start-up, steps, a save blocking 0.5 s, a
    crash, recomputed steps, the final save, shutdown), then a resumed session after a gap that is no
    one's. Times are exact binary fractions, so every category is compared exactly."""
    t = 1000.0

    def ev(kind, at, **f):
        return {"event": kind, "time": t + at, **f}

    def step(n, at, step_s=2.0, block=0.0):
        return ev(E.STEP, at, step=n, step_s=step_s, ckpt_block_s=block)

    history = [
        ev(E.SUPERVISOR_START, 0),
        ev(E.WORKER_START, 0.5, by="supervisor"),
        step(1, 10),
        step(2, 12, block=0.5),
        step(3, 14),  # startup: 0 -> 8 (step 1 began at 10 - 2)
        ev(E.WORKER_EXIT, 15, by="supervisor", exit_code=13),
        ev(E.RESTART, 15.25, by="supervisor"),
        ev(E.WORKER_START, 15.5, by="supervisor"),
        step(2, 25),
        step(3, 27),
        step(4, 29),  # 2 and 3 again: recomputed; recovery 15 -> 25
        ev(E.RUN_COMPLETE, 31, step=4),  # the worker's: 29 -> 31 waiting for the final save to be durable
        ev(E.WORKER_EXIT, 32, by="supervisor", exit_code=0),
        ev(E.RUN_COMPLETE, 33, by="supervisor"),
        # A resumed session 66 s later (the gap is no one's): its start-up counts as restart downtime.
        ev(E.SUPERVISOR_START, 100),
        step(5, 110),
        ev(E.HANG_DETECTED, 111, by="supervisor"),
        ev(E.WORKER_START, 113, by="supervisor"),
        step(6, 120, step_s=4.0),
        ev(E.RUN_COMPLETE, 122, step=6),
    ]
    history.insert(3, history.pop())  # file order is not time order: the ledger sorts by time
    led = goodput.ledger(history, t, t + 125)
    secs = led["goodput"]["seconds"]
    # Session 1 (0 -> 33): productive 2 + 1.5 + 2 + 2, recompute 2 + 2, checkpoint 0.5 + 2, startup 8,
    # shutdown 33 - 31 = 2, restart the rest: 33 - 24 = 9. Session 2 (100 -> 125): productive 2 + 4,
    # checkpoint 122 - 120 = 2, shutdown 125 - 122 = 3, restart 25 - 11 = 14 (its start 100 -> 108, and
    # 110 -> 116: the hang, its detection and the restart).
    assert secs == {
        "productive": 13.5,
        "recompute": 4.0,
        "straggler": 0.0,
        "checkpoint": 4.5,
        "startup": 8.0,
        "shutdown": 5.0,
        "restart": 23.0,
    }, secs
    assert led["wall_s"] == 58.0 and led["recoveries_s"] == [10.0, 9.0]
    assert led["goodput"]["fractions"] == {k: v / 58.0 for k, v in secs.items()}


def test_a_straggler_costs_the_group_its_lost_step_time_and_the_drain_its_restart():
    """The supervisor's verdicts carry the step seconds a slow process cost the group (lost_s): they move
    from productive to straggler. A drain (its group saved and stopped to restart without that node) costs
    the time from its exit to the first step of the group without it."""
    t = 0.0
    history = [
        {"event": E.SUPERVISOR_START, "time": t},
        *(
            {"event": E.STEP, "time": t + 6 + 2 * n, "step": n, "step_s": 2.0, "ckpt_block_s": 0.0}
            for n in (1, 2, 3, 4)
        ),
        {"event": E.STRAGGLER, "time": t + 13, "by": "supervisor", "process": 1, "lost_s": 1.5},
        {"event": E.PREEMPTED, "time": t + 15, "step": 4},  # the worker's: its save-and-stop took 1 s
        {"event": E.STRAGGLER_CLEARED, "time": t + 15.2, "by": "supervisor", "process": 1, "lost_s": 0.5},
        {"event": E.WORKER_EXIT, "time": t + 15.4, "by": "supervisor", "exit_code": 75},
        {"event": E.STRAGGLER_DRAINED, "time": t + 15.5, "by": "supervisor", "process": 1},
        {"event": E.WORKER_START, "time": t + 16, "by": "supervisor"},
        {"event": E.STEP, "time": t + 25, "step": 5, "step_s": 2.0, "ckpt_block_s": 0.0},  # began at 23
        {"event": E.RUN_COMPLETE, "time": t + 26, "step": 5},
    ]
    secs = goodput.ledger(history, t, t + 27)["goodput"]["seconds"]
    # productive 5 x 2 - 2 lost; straggler 2 lost + the drain 23 - 15.5; checkpoint 15 - 14 and 26 - 25;
    # startup 6 (the first step began at 6); shutdown 27 - 26; restart the rest
    assert secs == {
        "productive": 8.0,
        "recompute": 0.0,
        "straggler": 9.5,
        "checkpoint": 2.0,
        "startup": 6.0,
        "shutdown": 1.0,
        "restart": 0.5,
    }, secs


def test_the_goodput_bar_and_table_run_largest_first_and_say_so(tmp_path, monkeypatch):
    """The bar's parts are totals, not a timeline: drawn largest first, left to right, each starting where the
    one before ends, the legend titled with that order, and report.md's table in the same order. The ledger
    is goodput.ledger's own on a history where start-up (8 s) came first but is the third-largest share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = 1000.0
    history = [
        {"event": E.SUPERVISOR_START, "time": t},
        *({"event": E.STEP, "time": t + 8 + 2 * n, "step": n, "step_s": 2.0, "ckpt_block_s": 0.0} for n in (1, 2, 3)),
        {"event": E.WORKER_EXIT, "time": t + 15, "by": "supervisor", "exit_code": 13},
        {"event": E.STEP, "time": t + 30, "step": 4, "step_s": 2.0, "ckpt_block_s": 0.5},
        {"event": E.RUN_COMPLETE, "time": t + 32, "step": 4},
    ]
    led = goodput.ledger(history, t, t + 33)
    secs = led["goodput"]["seconds"]
    assert secs == {
        "productive": 7.5,
        "recompute": 0.0,
        "straggler": 0.0,
        "checkpoint": 2.5,
        "startup": 8.0,
        "shutdown": 1.0,
        "restart": 14.0,
    }, secs
    want = ["restart", "startup", "productive", "checkpoint", "shutdown"]  # recompute: 0 s, not drawn
    figs = {}
    monkeypatch.setattr(report, "_save", lambda fig, plt, out: figs.setdefault(Path(out).name, fig))
    report.plot_goodput(led, 1, plt, tmp_path / "goodput.png")
    (ax,) = figs["goodput.png"].axes
    drawn = [(p.get_x(), p.get_width(), p.get_facecolor()) for p in ax.patches]
    colour = matplotlib.colors.to_rgba
    assert [(round(x, 6), round(w, 6)) for x, w, _ in drawn] == [
        (0.0, 14.0),
        (14.0, 8.0),
        (22.0, 7.5),
        (29.5, 2.5),
        (32.0, 1.0),
    ]
    assert [c for *_, c in drawn] == [colour(report.GOODPUT_COLOURS[k]) for k in want]
    legend = ax.get_legend()
    assert [x.get_text().split()[0] for x in legend.get_texts()] == want
    assert legend.get_title().get_text() == "parts largest first (totals, not a timeline)"
    table = report.goodput_table(led)
    assert "largest first" in table[2] and [row.split(" | ")[0].lstrip("| ") for row in table[6:]] == [
        *want,
        "recompute",
        "straggler",
    ]
    plt.close("all")


def test_status_on_a_dir_that_is_not_a_run(tmp_path):
    r = _cli("status", str(tmp_path))
    assert r.returncode == 2 and "no events.jsonl" in r.stderr
