"""Benchmarks: the committed results carry every key the issue asks for, the table renders them (GPU rows
"not measured" without a GPU), the recovery split adds up, and the data-headroom benchmark runs (tiny
mode). No timing is asserted: speed belongs in the benchmarks' own ratios.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, child_env

from benchmarks import gpu_check, harness, recovery, run_all, table
from trainer.store import event_names as E

KEYS = (
    "step_overhead_ratio",
    "ckpt_blocking_vs_sync",
    "ckpt_throughput_ratio",
    "recovery_vs_cold",
    "data_headroom",
    "goodput_vs_model",
    "gpu",
)


def test_committed_results_have_every_key_and_render():
    res = json.loads((ROOT / "benchmarks" / "results" / "results.json").read_text())
    for key in KEYS:
        assert key in res, key
    assert res["command"].startswith("python -m benchmarks.run_all")
    assert {"machine", "versions", "git"} <= res.keys()
    md = table.render(res, run_all.HEADLINES)
    for key in KEYS[:-1]:
        assert f"`{key}`" in md
    if res["gpu"] == "not measured":
        assert md.count("not measured") >= 5


def test_recovery_split_adds_up():
    t = 1000.0
    evs = [
        {"event": E.WORKER_EXIT, "time": t + 0.4, "by": "supervisor"},
        {"event": E.WORKER_START, "time": t + 1.5, "by": "supervisor"},
        {"event": E.RESTORE, "time": t + 5.0, "seconds": 1.0},
        {"event": E.COMPILED, "time": t + 7.0, "seconds": 1.5},
        {"event": E.STEP, "time": t + 7.8, "step": 9},
    ]
    split = recovery.split_recovery(evs, t)
    want = {
        "detection": 0.4,
        "backoff": 1.1,
        "process_start": 2.5,
        "restore": 1.0,
        "other_setup": 0.5,
        "compile": 1.5,
        "first_step": 0.8,
        "total": 7.8,
    }
    assert {k: round(v, 6) for k, v in split.items() if k != "first_step_number"} == want
    assert split["first_step_number"] == 9


def test_data_headroom_runs(tmp_path):
    (tmp_path / "so.json").write_text(json.dumps({"trainer_tokens_per_s": 1000.0}))
    out = tmp_path / "dh.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.data_headroom",
            "--quick",
            "--work",
            str(tmp_path),
            "--input",
            str(tmp_path / "so.json"),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["data_headroom"] == res["pipeline_tokens_per_s"] / 1000.0
    assert res["pipeline"]["batches"] > 0 and res["gpu_124m_shape"]["batches"] > 0


@pytest.mark.slow  # a real worker
def test_kill_after_waits_for_the_checkpoint_to_be_sealed_not_only_committed(tmp_path):
    """A real worker hangs at step 4 with checkpoint 2 committed and sealed; its manifests are moved aside (the
    state between Orbax's commit and the sealing thread's manifest) and put back 2 s later. kill_after must
    not kill before they are back: a worker killed there resumes from an older checkpoint, or from scratch."""
    import threading
    import time

    from conftest import trainer_cmd

    from benchmarks import harness
    from trainer.store import manifest

    run = tmp_path / "run"
    one = ["mesh.cpu_devices=1", "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]
    over = ["train.steps=8", "checkpoint.every_steps=2", *one, "faults=[{kind: hang, step: 4}]"]
    step_dir, aside = run / "checkpoints" / "2", tmp_path / "aside"
    restored: list[float] = []

    def put_back():
        time.sleep(2.0)
        restored.append(time.time())
        os.rename(aside, step_dir / manifest.DIR)  # atomic: the manifests appear at once, as sealing leaves them

    with harness.Proc(trainer_cmd(run, *over, worker=True), tmp_path / "worker.log", child_env()) as proc:
        harness.wait_for(
            "the hang at step 4 with checkpoint 2 sealed",
            lambda: (h := harness.heartbeat(run)) and h["step"] == 4 and manifest.sealed(step_dir),
            timeout=240,
            proc=proc,
        )
        os.rename(step_dir / manifest.DIR, aside)
        assert step_dir.is_dir() and not manifest.sealed(step_dir)  # committed, not sealed
        threading.Thread(target=put_back, daemon=True).start()
        t_kill = recovery.kill_after(proc, run, 2, 4)
        assert restored and t_kill >= restored[0], "killed before checkpoint 2 was sealed"
        assert proc.wait(30) == -9 and manifest.sealed(step_dir)

    os.rename(step_dir / manifest.DIR, aside)  # never sealed: the wait gives up at its timeout, naming it
    t0 = time.time()
    try:
        recovery.wait_sealed(run, 2, timeout=1.5)
        raise AssertionError("wait_sealed returned for an unsealed checkpoint")
    except harness.BenchError as e:
        assert str(e).startswith("timed out after 2s waiting for checkpoint 2 committed and sealed"), e
    assert 1.5 <= time.time() - t0 < 5


@pytest.mark.slow  # trains the smoke's models on CPU for its 30-s budget
def test_gpu_check_writes_as_it_goes_and_stops_parts_at_their_budgets(tmp_path):
    """gpu_check --cpu-smoke (issue 47). The 124M run's own budget of 3 s ends inside it (its cold compile and
    20 steps take ~15 s on 2 idle cores), so it is stopped, its process killed, and the parts after it still
    run; the whole budget of 30 s ends inside a later part (the smoke takes minutes), which is stopped then, and
    every part after it is skipped. gpu.json holds every part in order, the provenance and the targets;
    gpu_logs.txt the stopped run's log tail. Bad arguments are one line and exit 2."""
    out, budget = tmp_path / "out", 30
    cmd = [sys.executable, "benchmarks/gpu_check.py", "--cpu-smoke", "--work", str(tmp_path / "work")]
    bad = [
        (["--out", str(ROOT / "pyproject.toml")], "is a file; pass a directory"),
        (["--part-s", "gpt-2b=3"], "no part named 'gpt-2b'"),
        (["--part-s", "gpt-1b=soon"], "expected NAME=SECONDS"),
    ]
    for args, said in bad:
        p = subprocess.run([*cmd, *args], cwd=ROOT, capture_output=True, text=True, timeout=60, env=child_env())
        assert p.returncode == 2 and said in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    cmd += ["--out", str(out), "--budget-s", str(budget), "--part-s", "gpt2-124m=3"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=child_env())
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads((out / "gpu.json").read_text())
    parts = list(gpu_check.PART_S)
    print({k: r.get(k) for k in ("wall_s", *parts)})
    assert [k for k in r if k in gpu_check.PART_S] == parts  # every part, in the order they ran
    assert r["wall_s"] < budget + 10, r["wall_s"]  # the budget, plus killing the run and collecting the result
    assert r["git"]["commit"] and r["machine"]["cpu_count"] and r["met"]["mfu_124m"] is False
    assert r["preflight"]["ok"] is False and r["attention"]["why"].startswith("cuDNN attention preflight failed")
    assert r["gpt2-124m"]["error"].startswith("stopped: its own budget of 3s spent during this part"), r
    assert "===== gpt2-124m.log" in (out / "gpu_logs.txt").read_text()
    spent = f"time budget of {budget}s spent"
    later = [r[k] for k in parts[parts.index("gpt2-124m") + 1 :]]
    skipped = [i for i, v in enumerate(later) if v.get("skipped") == spent]
    assert skipped and skipped == list(range(skipped[0], len(later))), later  # from some part on, all skipped
    before = later[: skipped[0]]
    assert before and all("error" not in v for v in before[:-1]), before  # they ran ...
    last = before[-1]  # ... the last one until the whole budget ended inside it (or just after it)
    assert "error" not in last or last["error"].startswith(f"stopped: {spent} during this part"), last


def test_provenance_without_git_or_outside_a_repository(tmp_path, monkeypatch):
    """A copy of the tree on a machine without git, or outside a repository: the result's commit is null."""
    assert harness.git(tmp_path) == {"commit": None, "uncommitted_files": None}
    monkeypatch.setenv("PATH", str(tmp_path))  # no git on it
    assert harness.git() == {"commit": None, "uncommitted_files": None}
    assert harness.provenance()["git"]["commit"] is None
