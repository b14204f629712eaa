"""The loss-spike runbook end to end with real processes, Orbax checkpoints and grain: a spike caused by a
region of garbage bytes is detected, rewound and exactly its batches skipped; an injected NaN recovers the
same way and the skip list survives a SIGKILL bitwise; a recurring spike softens, a persistent one gives up.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import ROOT, child_env, events, run_trainer, step_losses, summary, trainer_cmd
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from benchmarks.runbook_spike import write_corpora
from trainer.store import event_names as E
from trainer.supervise import exit_codes

pytestmark = pytest.mark.slow  # every test here trains end to end (fast loop: -m 'not slow')

# Micro runs leave their fast early drop by step ~20: judge from there, on a short window.
RB = [
    "runbook.window=16",
    "runbook.min_history=8",
    "runbook.warmup_steps=20",
    "runbook.probe_steps=4",
    "log.report=false",
]


def _first(run: Path, kind: str) -> dict:
    return next(e for e in events(run) if e["event"] == kind)


def _latest_losses(run: Path) -> dict[int, float]:
    return {s: v[-1] for s, v in step_losses(run).items()}


def test_a_data_spike_is_rewound_and_exactly_its_batches_skipped(tmp_path):
    # Batches 39-41 are random bytes, read by steps 40-42 in sequential order. The checkpoint of step 40
    # already holds the first garbage update; with keep_latest=1 only the runbook's retention pins keep a
    # checkpoint from before it (30).
    clean, spiked, bad = write_corpora(
        tmp_path / "data", batch_tokens=16 * 64, text_bytes=70 * 1024, garbage_at=39, garbage_batches=3
    )
    common = [*RB, "train.steps=60", "data.shuffle=false", "checkpoint.keep_latest=1"]
    run_trainer(tmp_path / "clean", *common, f"data.path={clean}", worker=True)
    assert not [e for e in events(tmp_path / "clean") if e["event"].startswith("spike")]  # no false positive
    run = tmp_path / "spiked"
    proc = run_trainer(run, *common, f"data.path={spiked}")
    assert "skipped batches 39-41" in proc.stderr

    detected, spike_exit = _first(run, E.SPIKE_DETECTED), _first(run, E.SPIKE_EXIT)
    assert (detected["step"], detected["began"], detected["signal"]) == (40, 40, "loss")
    assert detected["value"] > 2 * detected["mean"]
    assert (spike_exit["end"], spike_exit["open"], spike_exit["batches"]) == (42, False, bad)
    rewind, skip = _first(run, E.REWIND), _first(run, E.SKIP)
    assert (rewind["from"], rewind["to"], rewind["moved"]) == (43, 30, [40])
    assert (run / "rewound" / "40-1").is_dir()
    assert skip["batches"] == bad == json.loads((run / "runbook.json").read_text())["skips"]
    assert skip["samples"] == [[39 * 16, 42 * 16 - 1]]

    ref, got = _latest_losses(tmp_path / "clean"), _latest_losses(run)
    # Before the garbage both runs read the same bytes: bitwise the same (batch 38's last target byte is
    # the first garbage byte, so step 39 differs by one token of 1,024).
    assert all(got[s] == ref[s] for s in range(1, 39))
    assert abs(summary(run)["final_loss"] / summary(tmp_path / "clean")["final_loss"] - 1) < 0.02
    assert max(got[s] for s in range(40, 61)) < 1.5 * max(ref[s] for s in range(40, 61))


NAN = ["checkpoint.every_steps=5", "faults=[{kind: nan, step: 22}]"]


def test_an_injected_nan_recovers_and_the_skip_list_survives_sigkill_bitwise(tmp_path, reference_run):
    whole = tmp_path / "whole"
    run_trainer(whole, *RB, *NAN)
    detected = _first(whole, E.SPIKE_DETECTED)
    assert (detected["step"], detected["signal"], detected["began"]) == (23, "nonfinite_update_norm", 23)
    assert (_first(whole, E.REWIND)["to"], _first(whole, E.SKIP)["batches"]) == (20, [22])
    assert math.isfinite(summary(whole)["final_loss"])
    assert abs(summary(whole)["final_loss"] / summary(reference_run())["final_loss"] - 1) < 0.05

    # The same run, SIGKILLed (supervisor and worker) after the skip, once a later checkpoint exists
    # (25: restoring it needs the skip list for every step after it), then rerun by the same command.
    killed = tmp_path / "killed"
    slow = "faults=[{kind: nan, step: 22}, {kind: slow, step: 27, seconds: 1.0, count: 3}]"
    cmd = trainer_cmd(killed, *RB, "checkpoint.every_steps=5", slow)
    sup = psutil.Popen(cmd, cwd=ROOT, env=child_env(), stdout=open(tmp_path / "out", "w"), stderr=-2)
    deadline = time.time() + 240
    while not any(e["event"] == E.STEP and e["step"] >= 27 for e in _after_skip(killed)):
        assert time.time() < deadline and sup.poll() is None, "never got past the skip"
        time.sleep(0.1)
    workers = sup.children(recursive=True)
    sup.kill()
    psutil.wait_procs(workers, timeout=30)
    assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
    run_trainer(killed, *RB, "checkpoint.every_steps=5", slow)
    restores = [e["step"] for e in events(killed) if e["event"] == E.RESTORE]
    assert restores == [20, 25]  # the rewind, then the resume after the kill
    assert summary(killed)["params_sha256"] == summary(whole)["params_sha256"]
    assert _latest_losses(killed) == _latest_losses(whole)
    assert json.loads((killed / "runbook.json").read_text())["skips"] == [22]


def _after_skip(run: Path) -> list[dict]:
    if not (run / "events.jsonl").is_file():
        return []
    evs = events(run)
    i = next((i for i, e in enumerate(evs) if e["event"] == E.SKIP), None)
    return [] if i is None else evs[i:]


def test_a_recurring_spike_softens_and_a_persistent_one_gives_up(tmp_path):
    """A too-hot LR for one update at step 16: skip. Again at step 23, within recur_distance: soften (the
    softened LR in events, TensorBoard and config.yaml). That fault repeats on every attempt, so after
    max_actions=2 the runbook gives up with its own exit code and says what it tried."""
    run = tmp_path / "run"
    proc = run_trainer(
        run,
        "runbook.window=8",
        "runbook.min_history=4",
        "runbook.warmup_steps=10",
        "runbook.probe_steps=2",
        "runbook.b2=0.9",
        "runbook.max_actions=2",
        "log.report=false",
        "faults=[{kind: spike, step: 16, scale: 1000}, {kind: spike, step: 23, scale: 1000, repeat: true}]",
        check=False,
    )
    assert proc.returncode == exit_codes.RUNBOOK_GAVE_UP, proc.stderr[-2000:]
    assert "runbook gave up after 2 actions" in proc.stderr and "skipped batches" in proc.stderr
    assert "softened: LR scale 0.5, clip 0.5, b2 0.9" in proc.stderr
    evs = events(run)
    assert [e["event"] for e in evs if e["event"] in (E.SKIP, E.SOFTEN, E.RUNBOOK_GAVE_UP)] == [
        E.SKIP,
        E.SOFTEN,
        E.RUNBOOK_GAVE_UP,
    ]
    soften = _first(run, E.SOFTEN)
    lr = yaml.safe_load((run / "config.yaml").read_text())["optim"]
    assert (soften["lr_scale"], soften["clip_norm"], soften["b2"]) == (0.5, 0.5, 0.9)
    assert (lr["lr"], lr["clip_norm"], lr["b2"]) == (soften["peak_lr"], 0.5, 0.9) == (1e-3, 0.5, 0.9)

    tb = EventAccumulator(str(run / "tb"), purge_orphaned_data=False)  # every attempt's values
    tb.Reload()
    assert [e.value for e in tb.Scalars("runbook/lr_scale")] == [1.0, 0.5, 0.5]
    assert [e.value for e in tb.Scalars("runbook/action")] == [1.0, 2.0, 3.0]
    at25 = [e.value for e in tb.Scalars("optim/lr") if e.step == 25]  # before the soften, then after it
    assert len(at25) == 2 and math.isclose(at25[1], at25[0] / 2, rel_tol=1e-6)
    # The first step after the softened restart's restore (20 -> 21) already trains at half the LR: the
    # checkpoint held the old scale, and runbook.json's is set in the restored optimizer state.
    at21 = [e["lr"] for e in evs if e["event"] == E.STEP and e["step"] == 21]
    assert len(at21) == 2 and at21[1] == at21[0] / 2, at21
    # The dashboard's markers: each spike, rewind, skip and soften at the step of its event, written by the
    # worker that starts after it (none follows the give-up: runbook/action above marks that one).
    last_start = max(i for i, e in enumerate(evs) if e["event"] == E.WORKER_START)
    for name, kind in (("spike", E.SPIKE_DETECTED), ("rewind", E.REWIND), ("skip", E.SKIP), ("soften", E.SOFTEN)):
        want = [e["step"] for e in evs[:last_start] if e["event"] == kind]
        assert len(want) == (1 if name in ("skip", "soften") else 2), (name, want)
        tags = tb.Tags()["scalars"]  # a missing tag fails this assert (tb.Scalars alone would raise a KeyError)
        assert f"markers/{name}" in tags and [e.step for e in tb.Scalars(f"markers/{name}")] == want, (name, tags)
    # The run dir is left at the last good checkpoint: nothing newer than where the spike began.
    assert max(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == 20
