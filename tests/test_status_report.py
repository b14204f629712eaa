"""`python -m trainer status` and `python -m trainer report` on a real supervised run, while it is going
(after a crash and restart) and after it finished; the report is also written automatically at the end."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import matplotlib.image
from conftest import ROOT, child_env, trainer_cmd

from trainer.observe import status

PNGS = ("loss.png", "grad_norm.png", "throughput.png", "goodput.png")
# A crash at step 12 (restart from the step-10 checkpoint), then slow steps so the run stays observable.
RUN = ["train.steps=36", "faults=[{kind: crash, step: 12}, {kind: slow, step: 16, seconds: 0.25, count: 20}]"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=child_env())


def _steps_after_restart(run: Path) -> int:
    """The newest step of the second attempt (it restores from step 10, or starts over when the step-10
    save was still in flight at the crash)."""
    try:
        lines = (run / "events.jsonl").read_text().splitlines()
    except OSError:
        return 0
    evs = [json.loads(x) for x in lines if x.strip().endswith("}")]
    starts = [i for i, e in enumerate(evs) if e["event"] in status.ATTEMPT_START]
    if len(starts) < 2:
        return 0
    return max((e["step"] for e in evs[starts[-1]:] if e["event"] == "step"), default=0)


def _check_pngs(folder: Path) -> None:
    for name in PNGS:
        img = matplotlib.image.imread(folder / name)
        assert img.shape[0] > 200 and img.shape[1] > 600, (name, img.shape)


def test_status_and_report_while_running_and_after_restarts(tmp_path):
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
    assert status.steady_step_s(run) > 0


def test_status_on_a_dir_that_is_not_a_run(tmp_path):
    r = _cli("status", str(tmp_path))
    assert r.returncode == 2 and "no events.jsonl" in r.stderr
