"""Running the drill: a short calibration run (step time, start-up), the drilled run under its fault
schedule (supervised, as the configuration would train; the drill sends the preemptions and requeues the job
as a scheduler would), and the undisturbed reference run of the same steps. Every run is a real
`python -m trainer` in the drill's own directory; the user's run dir is never touched.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from trainer.config import Config, Fault, Phase, dump_yaml
from trainer.drill.plan import Planned
from trainer.observe.events import read_events
from trainer.observe.heartbeat import heartbeat_path
from trainer.observe.heartbeat import read as read_heartbeat
from trainer.store import rundir
from trainer.supervise import exit_codes

CALIBRATION_STEPS = 20
POLL_S = 0.2


class DrillError(RuntimeError):
    """A run the drill started could not finish (it says which and where its log is)."""


def configured(cfg: Config, run_dir: Path, *, faults: list[dict] | None = None, **train) -> Config:
    """`cfg` with the drill's changes: its run dir, the fault list, the data audit on (it changes nothing in
    training; the drill proves exactly-once consumption with it), and `train` keys (steps)."""
    return dataclasses.replace(
        cfg,
        run=dataclasses.replace(cfg.run, dir=str(run_dir)),
        data=dataclasses.replace(cfg.data, audit=True),
        train=dataclasses.replace(cfg.train, **train),
        faults=[Fault(**f) for f in (faults or [])],
    )


def _start(cfg: Config, name: str, work: Path) -> tuple[subprocess.Popen, Path]:
    path = work / f"{name}.yaml"
    path.write_text(dump_yaml(cfg))
    log = work / f"{name}.log"
    with open(log, "a") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainer", "--config", str(path)],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
    return proc, log


def run_plain(cfg: Config, name: str, work: Path, *, limit_s: float) -> float:
    """A supervised run to its end; returns its wall seconds."""
    t0 = time.time()
    proc, log = _start(cfg, name, work)
    try:
        code = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise DrillError(f"the {name} run took longer than {limit_s:.0f} s: see {log}") from None
    if code != 0:
        raise DrillError(f"the {name} run failed (exit {code}): see {log}")
    return time.time() - t0


def calibrate(cfg: Config, work: Path) -> dict:
    """Step time and start-up of this configuration here, from a short run (its compile also fills the
    compile cache the drill's restarts read)."""
    steps = min(cfg.train.steps, CALIBRATION_STEPS)
    run_dir = work / "calibrate"
    wall = run_plain(configured(cfg, run_dir, steps=steps, stop_at_step=0), "calibrate", work, limit_s=1800)
    evs = read_events(run_dir / rundir.EVENTS)
    step_s = [e["step_s"] - e.get("ckpt_block_s", 0.0) for e in evs if e["event"] == "step" and e["step"] > 3]
    ready = [e["startup_s"] for e in evs if e["event"] == "worker_ready"]
    if not step_s or not ready:
        raise DrillError(f"the calibration run recorded no steps: see {work / 'calibrate.log'}")
    return {"steps": steps, "step_s": statistics.median(step_s), "startup_s": ready[0], "wall_s": wall}


def drilled(cfg: Config, plan: list[Planned], work: Path, *, limit_s: float) -> dict:
    """The drilled run: its faults in the config, the preemptions sent by the drill (SIGTERM to the
    supervisor when process 0's heartbeat reaches the step) and the job requeued after each, as a scheduler
    would. Returns the sessions, the preemptions sent (step, time) and the wall seconds."""
    run_dir = work / "run"
    faults = [p.fault for p in plan if p.fault is not None]
    preempts = [p.step for p in plan if p.kind == "preempt"]
    run_cfg = configured(cfg, run_dir, faults=faults)
    sent, sessions, t0 = [], 0, time.time()
    while True:
        proc, log = _start(run_cfg, "run", work)
        sessions += 1
        while proc.poll() is None:
            hb = read_heartbeat(heartbeat_path(run_dir, 0))
            if preempts and hb and hb.phase == Phase.STEP and hb.step >= preempts[0]:
                preempts.pop(0)
                proc.send_signal(signal.SIGTERM)
                sent.append({"kind": "preempt", "step": hb.step, "time": time.time()})
            if time.time() - t0 > limit_s:
                proc.kill()
                raise DrillError(f"the drilled run took longer than {limit_s:.0f} s: see {log}")
            time.sleep(POLL_S)
        if proc.returncode == exit_codes.PREEMPTED and sent and sent[-1].get("requeued") is None:
            sent[-1]["requeued"] = time.time()
            continue
        return {"exit_code": proc.returncode, "sessions": sessions, "preempts": sent, "wall_s": time.time() - t0}


def reference(cfg: Config, work: Path, *, limit_s: float) -> dict:
    """The same steps undisturbed. The runbook's skips are part of the drilled run's data order, so the
    reference starts with them (its runbook.json); a softened LR is not (no undisturbed run has it)."""
    run_dir = work / "reference"
    run_dir.mkdir(parents=True, exist_ok=True)
    rb = rundir.read_json(work / "run" / rundir.RUNBOOK) or {}
    if rb.get("skips"):
        rundir.write_json(run_dir / rundir.RUNBOOK, {"skips": rb["skips"]})
    wall = run_plain(configured(cfg, run_dir), "reference", work, limit_s=limit_s)
    return {"wall_s": wall, "skips": rb.get("skips", []), "softened": rb.get("lr_scale", 1.0) != 1.0}


def fired(run_dir: Path) -> list[dict]:
    """The faults the workers fired, as they logged them (trainer.faults.injector)."""
    path = run_dir / rundir.FAULT_LOG
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
