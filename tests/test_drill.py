"""The fire drill: its seeded fault schedule, and drills of the tiny config end to end (real supervised
runs, real faults, the undisturbed reference run), passing, and failing with the right line."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MICRO, ROOT, child_env, sets

from trainer.config import load_config
from trainer.drill import plan
from trainer.drill.kinds import (
    AFTER_RESTART,
    BUDGETS,
    CORRUPTIONS,
    FIRES,
    HANG_TIMEOUTS,
    KINDS,
    NEEDS,
    RESTARTS,
    available,
)
from trainer.store import event_names as E

TINY = "configs/tiny.yaml"


def test_the_schedule_is_seeded_poisson_and_lands_each_kind_where_it_can():
    cfg = load_config(TINY)
    kinds, why = available(cfg)
    assert "bitflip" not in kinds and "replica_check_steps" in why["bitflip"]
    steps, step_s, mtbf = 4000, 0.1, 3.0
    a = plan.schedule(cfg, steps=steps, step_s=step_s, mtbf_s=mtbf, kinds=kinds, seed=7)
    assert a == plan.schedule(cfg, steps=steps, step_s=step_s, mtbf_s=mtbf, kinds=kinds, seed=7)
    assert a != plan.schedule(cfg, steps=steps, step_s=step_s, mtbf_s=mtbf, kinds=kinds, seed=8)
    # ~ steps * step_s / mtbf arrivals (133), a few dropped where no kind can land
    assert 100 <= len(a) <= 170, len(a)
    assert len({p.step for p in a}) == len(a) and all(3 <= p.step < steps - 3 for p in a)
    # one hang in a restart per failure at most: three restarts failing at one checkpoint are a crash loop
    kinds_in_order = [p.kind for p in sorted(a, key=lambda p: p.step)]
    assert not any(x in AFTER_RESTART and y in AFTER_RESTART for x, y in zip(kinds_in_order, kinds_in_order[1:]))
    assert {p.kind for p in a} == set(kinds)
    rb, every = cfg.runbook, cfg.checkpoint.every_steps
    rewinds = [p.step for p in a if p.kind in ("spike", "nan")]
    assert all(b - c > rb.recur_distance for c, b in zip(rewinds, rewinds[1:])), rewinds
    assert all(p.step >= rb.warmup_steps + rb.min_history for p in a if p.kind == "spike")
    assert len(rewinds) == rb.max_actions  # one more and the runbook stops the run for a human (exit 79)
    assert sum(p.kind == "ecc" for p in a) == 1
    after_save = [p for p in a if p.kind == "crash_after_save"]
    assert all(p.step % every == 1 and p.fault == {"kind": "crash", "step": p.step} for p in after_save)
    failures = [p.step for p in a if p.kind in RESTARTS]
    # A crash in a save is planned at the save it fires in; failures 2 steps apart at least: the supervisor reads
    # a crash the step after another as the same step failing again, and three in a row as a crash loop
    # (docs/drill.md: the micro drill below once planned one)
    assert all(p.step % every == 0 for p in a if p.kind == "crash_mid_save")
    assert all(y - x >= 2 for x, y in zip(failures, failures[1:])), failures
    micro = load_config(TINY, [*MICRO, *DRILL_SETS])
    few = plan.schedule(micro, steps=59, step_s=0.028, mtbf_s=1.0, kinds=DRILLED.split(","), seed=3)
    at = [p.step for p in few if p.kind in RESTARTS]
    assert len(at) >= 2 and all(y - x >= 2 for x, y in zip(at, at[1:])), few
    # a preemption (sent when the drill's poll sees its step) half a second of steps before the end at least
    sent = [
        p.step
        for seed in range(20)
        for p in plan.schedule(micro, steps=59, step_s=0.028, mtbf_s=1.0, kinds=["preempt", "crash"], seed=seed)
        if p.kind == "preempt"
    ]
    assert sent and max(sent) < 59 - 3 - plan.PREEMPT_LEAD_S / 0.028, sent
    for p in a:
        if p.kind in AFTER_RESTART:  # armed at a checkpoint step that a failure after it restores
            assert p.fault["phase"] == p.kind.split("_")[1] and p.fault["step"] % every in (0, 1)
            assert p.fault["step"] >= 1 and any(s > p.fault["step"] + every - 1 for s in failures)
        if p.kind == "slow":  # the throughput alert's window of pace behind it, since the start or a failure
            assert p.step > max([s for s in failures if s < p.step], default=0) + cfg.alerts.throughput_window
        if p.kind == "corrupt":
            assert p.fault["how"] in CORRUPTIONS
        if p.kind == "preempt":
            assert p.fault is None  # the drill sends it
    off = dataclasses.replace(cfg, runbook=dataclasses.replace(cfg.runbook, enabled=False))
    assert {"spike", "nan"} <= set(available(off)[1])
    # node loss: only inside an allocation with a spare, once per spare, never the first node's processes
    assert "not inside a SLURM allocation" in why["node"]
    slurm = load_config(TINY, ["launch.mode=slurm", "launch.processes=4", "launch.processes_per_node=2"])
    assert "no spare node" in available(slurm, 0)[1]["node"] and "node" in available(slurm, 2)[0]
    b = plan.schedule(slurm, steps=steps, step_s=step_s, mtbf_s=mtbf, kinds=["node", "crash"], seed=7, spares=2)
    lost = [p.fault for p in b if p.kind == "node"]
    assert len(lost) == 2 and all(f["kind"] == "node" and f["process"] in (2, 3) for f in lost), lost


def test_each_kind_is_one_row_of_known_values():
    """The table names only what the schedule and the trainer know: a typo in a row would land nowhere."""
    from trainer.config import FAULT_KINDS, FAULT_PHASES, SupervisorConfig

    timeouts = {f.name for f in dataclasses.fields(SupervisorConfig)}
    for name, row in KINDS.items():
        assert row.fires in FIRES and row.needs in ("", *NEEDS) and row.at_most in ("", *BUDGETS), name
        assert row.by_drill or (row.fault or name) in FAULT_KINDS, name
        assert row.phase in ("", *FAULT_PHASES) and (not row.hang_timeout or row.hang_timeout in timeouts), name
        assert bool(row.phase) == (row.fires in ("restart", "phase")), name  # a hang outside a step names its phase
        assert row.draws in ("", "how", "process"), name
    assert set(HANG_TIMEOUTS) == {k for k in KINDS if k.startswith("hang")}
    assert not RESTARTS & AFTER_RESTART  # failure_before reads a hang in a restart as taken, not as a failure


def _same(faults: list[plan.Planned], want: list[tuple]) -> None:
    got = [(p.kind, p.step, p.fault) for p in faults]
    assert got == want and json.dumps(got) == json.dumps(want)  # each entry's keys in order too: drill.json's


def test_a_seed_draws_the_same_plan_as_it_always_did():
    """Plans pinned by value: a seed names one plan whatever shape the planner's code takes, so a drill can be
    rerun and its plan read back."""
    micro = load_config(TINY, [*MICRO, *DRILL_SETS])
    _same(
        plan.schedule(micro, steps=59, step_s=0.028, mtbf_s=1.0, kinds=DRILLED.split(","), seed=3),
        [
            ("corrupt", 9, {"kind": "corrupt", "step": 9, "how": "flip"}),
            ("crash_mid_save", 50, {"kind": "crash_mid_save", "step": 50}),
        ],
    )
    tiny = load_config(TINY)
    _same(
        plan.schedule(tiny, steps=400, step_s=0.1, mtbf_s=2.0, kinds=available(tiny)[0], seed=7),
        [
            ("hang", 7, {"kind": "hang", "step": 7}),
            ("crash", 17, {"kind": "crash", "step": 17}),
            ("corrupt", 19, {"kind": "corrupt", "step": 19, "how": "flip"}),
            ("crash", 28, {"kind": "crash", "step": 28}),
            ("hang_startup", 76, {"kind": "hang", "step": 1, "phase": "startup"}),
            ("preempt", 77, None),
            ("hang_startup", 88, {"kind": "hang", "step": 1, "phase": "startup"}),
            ("preempt", 90, None),
            ("hang_startup", 93, {"kind": "hang", "step": 1, "phase": "startup"}),
            ("disk_full", 113, {"kind": "disk_full", "step": 113}),
            ("preempt", 172, None),
            ("crash", 190, {"kind": "crash", "step": 190}),
            ("crash", 265, {"kind": "crash", "step": 265}),
            ("hang", 281, {"kind": "hang", "step": 281}),
            ("hang", 288, {"kind": "hang", "step": 288}),
            ("preempt", 303, None),
            ("disk_full", 311, {"kind": "disk_full", "step": 311}),
            ("crash_after_save", 351, {"kind": "crash", "step": 351}),
            ("ecc", 352, {"kind": "ecc", "step": 352}),
            ("hang", 355, {"kind": "hang", "step": 355}),
            ("hang", 371, {"kind": "hang", "step": 371}),
            ("nan", 388, {"kind": "nan", "step": 388}),
            ("corrupt", 392, {"kind": "corrupt", "step": 392, "how": "truncate"}),
        ],
    )
    evals = load_config(TINY, ["eval.every_steps=25"])
    rewinds = ["slow", "spike", "nan", "hang_checkpoint", "hang_eval", "crash_mid_save", "bitflip"]
    _same(
        plan.schedule(evals, steps=600, step_s=0.1, mtbf_s=6.0, kinds=rewinds, seed=1),
        [
            ("nan", 8, {"kind": "nan", "step": 8}),
            ("bitflip", 26, {"kind": "bitflip", "step": 26}),
            ("hang_eval", 112, {"kind": "hang", "step": 112, "phase": "eval"}),
            ("bitflip", 175, {"kind": "bitflip", "step": 175}),
            ("hang_eval", 189, {"kind": "hang", "step": 189, "phase": "eval"}),
            ("hang_eval", 191, {"kind": "hang", "step": 191, "phase": "eval"}),
            ("spike", 225, {"kind": "spike", "step": 225}),
            ("hang_eval", 296, {"kind": "hang", "step": 296, "phase": "eval"}),
            ("spike", 373, {"kind": "spike", "step": 373}),
            ("hang_checkpoint", 427, {"kind": "hang", "step": 427, "phase": "checkpoint"}),
            ("slow", 566, {"kind": "slow", "step": 566, "count": 20, "step_multiple": 3.0}),
            ("bitflip", 567, {"kind": "bitflip", "step": 567}),
        ],
    )
    slurm = load_config(TINY, ["launch.mode=slurm", "launch.processes=4", "launch.processes_per_node=2"])
    lose = ["node", "corrupt", "slow", "hang_compile", "ecc", "crash"]
    _same(
        plan.schedule(slurm, steps=300, step_s=0.1, mtbf_s=2.0, kinds=lose, seed=1, spares=2),
        [
            ("node", 3, {"kind": "node", "step": 3, "process": 3}),
            ("ecc", 5, {"kind": "ecc", "step": 5}),
            ("crash", 18, {"kind": "crash", "step": 18}),
            ("node", 49, {"kind": "node", "step": 49, "process": 3}),
            ("hang_compile", 50, {"kind": "hang", "step": 1, "phase": "compile"}),
            ("corrupt", 61, {"kind": "corrupt", "step": 61, "how": "torn"}),
            ("crash", 72, {"kind": "crash", "step": 72}),
            ("crash", 105, {"kind": "crash", "step": 105}),
            ("hang_compile", 163, {"kind": "hang", "step": 50, "phase": "compile"}),
            ("corrupt", 164, {"kind": "corrupt", "step": 164, "how": "torn"}),
            ("hang_compile", 179, {"kind": "hang", "step": 100, "phase": "compile"}),
            ("crash", 202, {"kind": "crash", "step": 202}),
            ("crash", 228, {"kind": "crash", "step": 228}),
            ("hang_compile", 233, {"kind": "hang", "step": 150, "phase": "compile"}),
            ("crash", 289, {"kind": "crash", "step": 289}),
            ("corrupt", 295, {"kind": "corrupt", "step": 295, "how": "torn"}),
        ],
    )


def test_each_fault_is_matched_to_its_detection_and_the_first_step_past_where_the_run_was():
    from trainer.drill import checks

    P = plan.Planned
    schedule = [
        P("crash", 12, {"kind": "crash", "step": 12}),
        P("preempt", 20, None),
        P("hang_restore", 25, {"kind": "hang", "step": 10, "phase": "restore"}),
        P("slow", 40, {"kind": "slow", "step": 40}),
    ]
    fired = [
        {"index": 0, "step": 12, "time": 100.0},
        {"index": 1, "step": 10, "phase": "restore", "time": 130.0},
        {"index": 2, "step": 40, "time": 200.0},
    ]
    preempts = [{"kind": "preempt", "step": 21, "time": 150.0}]

    def step(s, t):
        return {"event": E.STEP, "step": s, "time": t}

    evs = [
        *(step(s, 90.0 + s * 0.5) for s in range(1, 12)),  # up to step 11 at 95.5
        {"event": E.WORKER_EXIT, "exit_code": 13, "time": 100.5},
        {"event": E.RESTORE, "step": 10, "time": 104.0},
        *(step(s, 100.0 + s) for s in range(11, 14)),  # 11-13: step 12 again at 112, first new at 112
        {"event": E.HANG_DETECTED, "time": 140.0},
        {"event": E.RESTORE, "step": 10, "time": 143.0},
        *(step(s, 135.0 + s) for s in range(11, 22)),
        {"event": E.PREEMPTED, "by": "supervisor", "time": 151.0},
        {"event": E.RESTORE, "step": 20, "time": 160.0},
        *(step(s, 145.0 + s) for s in range(21, 60)),
        {"event": E.ALERT, "kind": "throughput_drop", "time": 203.0},
        {"event": E.ALERT_CLEARED, "kind": "throughput_drop", "time": 230.0},
    ]
    rows = {r["kind"]: r for r in checks.faults(schedule, fired, preempts, evs)}
    crash, hang, pre, slow = rows["crash"], rows["hang_restore"], rows["preempt"], rows["slow"]
    assert (crash["detected_by"], crash["detect_s"], crash["recomputed"]) == (E.WORKER_EXIT, 0.5, 1)
    assert crash["healed"] and crash["productive_s"] == 12.0  # step 12 (past 11) at 112
    assert (hang["detected_by"], hang["detect_s"], hang["recomputed"]) == (E.HANG_DETECTED, 10.0, 3)
    assert hang["productive_s"] == 19.0  # step 14 (past 13) at 149
    # the preempted worker ran on to its save (step 20, what the requeued run restores): nothing recomputed
    assert (pre["detected_by"], pre["recomputed"], pre["productive_s"]) == (E.PREEMPTED, 0, 16.0)
    assert (slow["detected_by"], slow["detect_s"], slow["healed"], slow["productive_s"]) == (E.ALERT, 3.0, True, 30.0)
    # a preemption at the end: the worker saves the final step and the requeued run completes at once
    end = [step(s, 100.0 + s) for s in range(1, 21)] + [
        {"event": E.PREEMPTED, "by": "supervisor", "time": 121.0},
        {"event": E.RESTORE, "step": 20, "time": 125.0},
        {"event": E.RUN_COMPLETE, "time": 126.0},
    ]
    [last] = checks.faults([P("preempt", 19, None)], [], [{"kind": "preempt", "step": 19, "time": 119.5}], end)
    assert last["healed"] and last["productive_s"] == 6.5 and last["recomputed"] == 0
    # a fault nothing noticed is reported as such
    [lost] = checks.faults(schedule[:1], fired[:1], [], [e for e in evs if e["event"] != E.WORKER_EXIT][:11])
    assert lost["detected_by"] is None and not lost["healed"]


def test_a_drill_too_short_to_show_anything_is_refused_grown_or_failed():
    """The 4-minute tiny drill at one fault every 12 s (0.43 s steps, 10 s start-ups): its hangs wait out 120 and
    600 s timeouts, so it once planned 1 fault (a preemption) and passed. Now: refused before anything runs (the
    timeouts, the minutes it needs, what to lower); without the hang kinds, grown at the same MTBF to hold 8
    faults of 4 kinds; a plan or a run short of them, or a planned fault that never fired, is a failed check."""
    from trainer.drill import checks

    # the checks: the plan of the 4-minute drill (one preemption, sent)
    P = plan.Planned
    short = checks.coverage([P("preempt", 27, None)], [], [{"kind": "preempt", "step": 27, "time": 1.0}])
    assert len(short) == 1 and short[0].startswith(
        "the plan held 1 fault(s) of 1 kind(s) (preempt): a drill of fewer than 8 faults of 4"
    ), short
    eight = [P(k, 10 * i + 5, {"kind": k, "step": 10 * i + 5}) for i, k in enumerate(["crash", "nan"] * 3)]
    eight += [P("preempt", 70, None), P("ecc", 80, {"kind": "ecc", "step": 80})]
    fired = [{"index": i, "step": p.step} for i, p in enumerate(q for q in eight if q.fault)]
    sent = [{"kind": "preempt", "step": 70, "time": 1.0}]
    assert checks.coverage(eight, fired, sent) == []
    # a fault that never fired (the ECC one, the preemption) fails the drill, each named
    [never] = checks.coverage(eight, fired[:-1], [])
    assert never.startswith("2 planned fault(s) never fired: preempt at step 70, ecc at step 80"), never
    [nine] = checks.coverage(eight, fired, sent, min_faults=9)
    assert nine.startswith("the plan held 8 fault(s) of 4 kind(s) (crash, ecc, nan, preempt): a drill of fewer than 9")
    assert checks.coverage(eight[:4], fired[:4], [], min_faults=2, min_kinds=2) == []

    # the sizing: refused before anything runs, or grown at the same MTBF
    cfg = load_config(TINY)
    kinds, _ = available(cfg)
    with pytest.raises(plan.Refused) as e:  # before calibration: the MTBF and the hang timeouts alone
        plan.check(cfg, kinds, minutes=4, mtbf_s=12, named=False)
    line = str(e.value)
    assert "8 faults of 4+ kinds" in line and "need at least 24.0 min here, not 4" in line, line
    assert "supervisor.startup_timeout_s 600 s" in line and "supervisor.step_timeout_s 120 s" in line, line
    assert "leave the hang kinds out (--faults crash," in line and line.endswith("drill --minutes 24 or more"), line
    cal = dict(step_s=0.43, startup_s=10.0)
    with pytest.raises(plan.Refused, match=r"need ~26\.9 min here, not 4 .* \(10 s start-up \+ 11 s recomputed\)"):
        plan.check(cfg, kinds, minutes=4, mtbf_s=12, named=False, **cal)
    with pytest.raises(plan.Refused, match=r"--faults names 2 kind\(s\) \(crash, preempt\).*--min-kinds"):
        plan.check(cfg, ["crash", "preempt"], minutes=60, mtbf_s=12, named=True)
    rest = [k for k in kinds if k not in HANG_TIMEOUTS]
    plan.check(cfg, rest, minutes=4, mtbf_s=12, named=True, **cal)  # ~4.5 min: within 1.5x of 4
    sized = plan.size(cfg, rest, minutes=4, mtbf_s=12, seed=5, **cal)
    assert sized.grown_from and sized.steps > sized.grown_from, sized  # 195 steps drew too few
    assert len(sized.plan) >= 8 and len({p.kind for p in sized.plan}) >= 4, sized.plan
    assert sized.plan == plan.schedule(cfg, steps=sized.steps, step_s=0.43, mtbf_s=12, kinds=rest, seed=5)
    assert sized.priced_s <= plan.GROW_LIMIT * 4 * 60
    assert sized.priced_s == plan.priced_s(cfg, sized.plan, sized.steps, **cal)
    with pytest.raises(plan.Refused, match=r"this seed's draw, grown until its price passed 1\.5x the 4 min asked"):
        plan.size(cfg, kinds, minutes=4, mtbf_s=12, seed=5, **cal)
    # 20 minutes hold 8 faults as drawn (not grown), and 4 minutes 2 faults of 2 kinds (the micro drill's thresholds)
    assert not plan.size(cfg, rest, minutes=20, mtbf_s=12, seed=5, **cal).grown_from
    assert not plan.size(cfg, rest, minutes=4, mtbf_s=12, seed=5, min_faults=2, min_kinds=2, **cal).grown_from


def _drill(
    tmp_path: Path, *args: str, minutes: float = 0.6, mtbf: float = 4.0
) -> tuple[subprocess.CompletedProcess, Path]:
    work = tmp_path / "drill"
    cmd = [
        sys.executable,
        "-m",
        "trainer",
        "drill",
        "--config",
        TINY,
        *sets(*MICRO, *DRILL_SETS),
        "--set",
        f"run.dir={tmp_path / 'mine'}",
        "--minutes",
        str(minutes),
        "--mtbf",
        str(mtbf),
        "--dir",
        str(work),
        *args,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=child_env())
    return proc, work


# Timeouts as a drill of these micro steps needs them (a step ~50 ms, a start ~5 s): the defaults (2 min a
# step, 10 for a start) would spend the drill waiting.
DRILLED = "crash,crash_after_save,hang,hang_restore,crash_mid_save,corrupt,preempt"  # the micro drill's kinds
DRILL_SETS = (
    "supervisor.step_timeout_s=6",
    "supervisor.restore_timeout_s=15",
    "supervisor.startup_timeout_s=40",
    "checkpoint.every_steps=50",  # ~1.5 s of these steps: longer than a save takes to become durable
)


@pytest.mark.slow
def test_a_drill_of_the_micro_config_heals_every_fault_and_ends_as_the_undisturbed_run(tmp_path):
    kinds = DRILLED
    # 2 faults of 2 kinds, not 8 of 4: the suite's budget (the thresholds: the test above)
    few = ["--min-faults", "2", "--min-kinds", "2"]
    scale = ["--gpus", "64", "--gpu-mtbf-hours", "20000", "--days", "7"]  # the projection to a real run
    # 1.2 minutes: the drill prices each fault at the calibration's cold start-up (~24 s under the suite's load),
    # so at 0.6 this seed's plan held 2 faults only by luck (the first draw is taken whatever its price), and
    # not once crashes were kept 2 steps apart; at 1.2 it holds them for any calibration from 20 to 150 ms a step
    # and 6 to 35 s of start-up (plan.size, scanned)
    proc, work = _drill(tmp_path, "--faults", kinds, "--seed", "3", *few, *scale, minutes=1.2, mtbf=1.0)
    res = json.loads((work / "drill.json").read_text())
    proj = res["projection"]
    assert {k: proj["inputs"][k] for k in ("gpus", "mtbf_hours", "days")} == {
        "gpus": 64,
        "mtbf_hours": 20000,
        "days": 7,
    }
    assert proj["expected_failures"] == pytest.approx(64 * 7 * 24 / 20000), proj  # GPU-hours over the GPU MTBF
    # Every check holds, except that goodput against the model's expectation may miss here by chance: a
    # handful of failures, some right after a fault that destroyed the newest checkpoint (the 20-minute drill
    # in benchmarks/results/drill/ is where the comparison is shown: 49.5% against 49.9%).
    unlucky = [line for line in res["failed"] if not line.startswith("goodput")]
    assert proc.returncode == (1 if res["failed"] else 0) and not unlucky, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"drill: in {work}" in proc.stdout and ("DRILL PASSED" in proc.stdout) == (not res["failed"])
    rows = res["faults"]
    # how many depends on the step time the calibration measured (faults arrive in seconds of training)
    # (under a fresh-clone CI run's load a 0.45-minute drill fired only 2: start-ups ate its minutes)
    assert len(rows) >= 2 and len({r["kind"] for r in rows}) >= 2, [r["kind"] for r in rows]
    assert all(r["healed"] and r["detect_s"] is not None and r["productive_s"] >= r["detect_s"] for r in rows), rows
    dp = res["data_and_params"]
    assert dp["hash_equal"] and not dp["audit_problems"] and dp["audit"]["compared_steps"] == res["steps"], dp
    gp = res["goodput"]
    assert 0 < gp["measured"] < 1 and 0 < gp["predicted"] < 1 and gp["within"] == (not res["failed"]), gp
    assert (work / "drill.png").stat().st_size > 10_000
    assert not (tmp_path / "mine").exists()  # the configuration's run dir is never touched
    print(proc.stdout[proc.stdout.index("  #") :])


def test_the_setup_lines_name_what_breaks_and_the_fix(tmp_path):
    from trainer.drill import checks

    cfg = load_config(TINY)
    ck = cfg.checkpoint

    def with_ck(**kw):
        return dataclasses.replace(cfg, checkpoint=dataclasses.replace(ck, **kw))

    crashes = [{"recomputed": 40, "productive_s": 9.0}, {"recomputed": 70, "productive_s": 11.0}]
    run = tmp_path / "run"
    run.mkdir()
    assert checks.setup(cfg, [], crashes, run) == []  # the tiny config as shipped: nothing to say
    [line] = checks.setup(with_ck(every_steps=0), [], crashes, run)
    assert line.startswith("no periodic checkpoint") and "110 steps recomputed over 2 restarts" in line
    fast = with_ck(every_steps=0, local_dir=str(tmp_path / "local"), local_every_steps=10)
    lines = checks.setup(fast, [], crashes, run)
    assert lines[0].startswith("a fast tier only") and lines[1].startswith("fast tier on the same disk")
    full = [{"event": E.CHECKPOINT_FAILED, "message": "No space left on device"}]
    [line] = checks.setup(cfg, full, crashes, run)
    assert "could not be written: No space left on device" in line and "keep_latest (3) + 1" in line
    injected = [{"event": E.CHECKPOINT_FAILED, "message": "No space left on device (injected: disk_full fault)"}]
    assert checks.setup(cfg, injected, crashes, run) == []  # the drill's own disk_full: no setup problem
    [line] = checks.setup(
        dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, compile_cache="")), [], crashes, run
    )
    assert line.startswith("restart 10 s") and "run.compile_cache is off" in line


@pytest.mark.slow
def test_startup_and_restore_hangs_wait_for_a_restart_from_their_step(tmp_path):
    """The drill's hang_startup and hang_restore: armed at step 10, they spare the fresh start (whose start-up
    and restore phases find no checkpoint: step 0) and hang the start-up, then the restore, of the restarts
    after the crash at 25 (from checkpoint 10 or 20); each is detected by its own timeout and the run goes on
    to the end."""
    from conftest import events, run_trainer

    run = tmp_path / "run"
    faults = (
        "faults=[{kind: crash, step: 25}, {kind: hang, step: 10, phase: startup}, "
        "{kind: hang, step: 10, phase: restore}]"
    )
    timeouts = ("supervisor.startup_timeout_s=15", "supervisor.restore_timeout_s=10")
    run_trainer(run, faults, *timeouts, "checkpoint.every_steps=10")
    fired = [json.loads(line) for line in (run / "faults.jsonl").read_text().splitlines()]
    assert [(f["kind"], f["phase"]) for f in fired] == [("crash", "step"), ("hang", "startup"), ("hang", "restore")]
    evs = events(run)
    hangs = [e for e in evs if e["event"] == E.HANG_DETECTED]  # (a slow fresh start is no hang: 10 s)
    assert [h["phase"] for h in hangs] == ["startup", "restore"] and hangs[0]["time"] > fired[1]["time"], hangs
    # each fired in a phase that found checkpoint 10 or 20 committed, never in the start's (0); the last
    # attempt restored 10 or 20 (the newest sealed one: 20's manifest may not have been written)
    [restored] = [e["step"] for e in evs if e["event"] == E.RESTORE]
    assert all(f["step"] in (10, 20) for f in fired[1:]) and 10 <= restored <= fired[2]["step"], (fired, restored)
    assert evs[-1]["event"] == E.RUN_COMPLETE


@pytest.mark.slow
def test_a_disk_full_fault_fails_its_save_and_the_run_restarts_when_there_is_room(tmp_path, reference_run):
    """The drill's disk_full: armed at step 12, the next durable save (15) fails as a full disk fails it (the
    worker's checkpoint_failed, exit 81); the supervisor finds room for one more checkpoint at once (the disk
    is not really full) and restarts from 10 without waiting; the run ends as the undisturbed one."""
    from conftest import events, run_trainer, summary

    run = tmp_path / "run"
    run_trainer(run, "checkpoint.every_steps=5", "faults=[{kind: disk_full, step: 12}]")
    evs = events(run)
    failures = [e for e in evs if e["event"] == E.CHECKPOINT_FAILED]
    assert len(failures) == 1, [e["event"] for e in evs]  # the save it names failed, and only that one
    (failed,) = failures
    assert failed["step"] == 15 and "the disk is full" in failed["message"] and "injected" in failed["message"]
    assert [(e["reason"], e["step"]) for e in evs if e["event"] == E.RESTART] == [("disk full", 15)]
    assert not [e for e in evs if e["event"] == E.ALERT and e.get("kind") == "disk_full"]  # room at once
    assert [e["step"] for e in evs if e["event"] == E.RESTORE] == [10] and evs[-1]["event"] == E.RUN_COMPLETE
    assert summary(run)["params_sha256"] == summary(reference_run())["params_sha256"]


@pytest.mark.slow
def test_a_corrupt_fault_hits_the_checkpoint_the_restart_reads_first(tmp_path, reference_run):
    """With a fast tier, the newest checkpoint a restart reads is the local one: the corrupt fault at step 19
    flips bytes in local step 15 (sealed by then: steps 16-18 slowed), not durable 10, which no restart would
    read; the restart rejects it and resumes from durable 10; the run ends as the undisturbed one."""
    from conftest import events, run_trainer, summary

    run = tmp_path / "run"
    local = [f"checkpoint.local_dir={tmp_path / 'local'}", "checkpoint.local_every_steps=5"]
    faults = "faults=[{kind: slow, step: 16, seconds: 0.5, count: 3}, {kind: corrupt, step: 19, how: flip}]"
    run_trainer(run, *local, faults)
    [_, fired] = [json.loads(line) for line in (run / "faults.jsonl").read_text().splitlines()]
    assert fired["hit"].startswith("local:15/state/"), fired
    evs = events(run)
    assert [(e["step"], e["tier"]) for e in evs if e["event"] == E.CHECKPOINT_REJECTED] == [(15, "local")]
    assert [(e["step"], e["tier"]) for e in evs if e["event"] == E.RESTORE] == [(10, "durable")]
    assert summary(run)["params_sha256"] == summary(reference_run())["params_sha256"]


def test_goodput_is_compared_with_the_model_on_the_same_measured_costs():
    """Two crashes at a random step losing 25 and 35 steps of a 50-step interval (the model: 25 each), one
    corrupt checkpoint losing 70 (priced as measured); 0.1 s steps."""
    from trainer.drill import checks

    cfg = load_config(TINY)  # checkpoint.every_steps 50
    secs = {"productive": 100.0, "recompute": 13.0, "checkpoint": 2.0, "restart": 30.0, "straggler": 0.0}
    rows = [
        {"kind": "crash", "recomputed": 25},
        {"kind": "hang", "recomputed": 35},
        {"kind": "corrupt", "recomputed": 70},
        {"kind": "ecc", "recomputed": None},
    ]
    gp = checks.goodput({"goodput": {"seconds": dict(secs, startup=5.0, shutdown=1.0)}}, rows, cfg, 0.1)
    # expected: 2 x 25 steps x 0.1 s (model) + 7 s (corrupt, measured) + 32 s paid = 44 s besides productive
    assert gp["uniform_failures"] == 2 and gp["recompute_s"]["model_uniform"] == pytest.approx(5.0)
    assert gp["predicted"] == pytest.approx(100 / 144) and gp["measured"] == pytest.approx(100 / 145)
    assert gp["within"] and gp["recomputed_per_uniform"] == 30
    far = [dict(r, recomputed=200) if r["kind"] == "crash" else r for r in rows]
    worse = checks.goodput({"goodput": {"seconds": dict(secs, recompute=30.0)}}, far, cfg, 0.1)
    assert not worse["within"], worse  # 17.5 s more recomputed than expected: beyond 5% and beyond chance
    # a drilled run that never trained a step (a crash loop before its first) has no goodput to price
    assert checks.goodput({"goodput": {"seconds": dict(secs, productive=0.0)}}, rows, cfg, 0.1) is None


@pytest.mark.slow
def test_a_drill_inside_a_slurm_allocation_loses_a_node_and_passes(tmp_path):
    """`sbatch launch/slurm.sbatch drill ...` on a private three-node cluster: two nodes train, one is the spare.
    Every run of the drill goes through srun on the allocation; its faults include a node lost whole (its
    slurmd, slurmstepd and task at once, its node-local tier with them), blamed, replaced by the spare, and
    healed; then preemptions of the new pair (the drill's SIGTERM, its requeue inside the allocation). The drill
    passes every check (goodput may miss by chance, as in the micro drill), its undisturbed run on the nodes
    left."""
    from multihost import TWO, group_overrides, sbatch_trainer, small_corpus
    from slurm_cluster import local_slurm, wait_job
    from test_node_loss import CLUSTER, NODE_LOCAL
    from test_slurm_job import _require_slurm

    _require_slurm()
    corpus, work, out = small_corpus(tmp_path / "corpus"), tmp_path / "drill", tmp_path / "job.out"
    with local_slurm(tmp_path / "slurm", nodes=3, node_local=NODE_LOCAL, **CLUSTER) as env:
        tmpfs = env["LOCAL_SLURM_NODE_LOCAL_MODE"] == "tmpfs"
        local = [f"checkpoint.local_dir={NODE_LOCAL}/ckpt", "checkpoint.local_every_steps=10"] if tmpfs else []
        overrides = [*MICRO, *DRILL_SETS, f"run.dir={tmp_path / 'mine'}", *group_overrides(corpus, *TWO), *local]
        args = ["drill", "--config", TINY, *sets(*overrides, "launch.processes_per_node=1"), "--dir", str(work)]
        args += ["--faults", "node,preempt", "--mtbf", "1.5", "--minutes", "0.3", "--seed", "33"]
        args += ["--min-faults", "1", "--min-kinds", "1"]  # a node loss, as drawn (the thresholds: the tests above)
        job, _ = sbatch_trainer(env, nodes=3, per_node=1, out=out, args=args)
        state = wait_job(job, env, timeout=600)
    log = out.read_text()
    res = json.loads((work / "drill.json").read_text())
    unlucky = [line for line in res["failed"] if not line.startswith("goodput")]
    assert state == ("FAILED" if res["failed"] else "COMPLETED") and not unlucky, log[-4000:]
    assert res["launch"] == "slurm" and res["spare_nodes"] == 1, res
    rows = res["faults"]
    [node] = [r for r in rows if r["kind"] == "node"]
    assert node["detected_by"] == E.NODE_SUSPECT and node["healed"], node
    # the node first, then (at a step time over ~0.12 s, as here) a preemption or more: every planned fault fired
    assert [r["kind"] for r in rows] == [p["kind"] for p in res["planned"]] and all(r["healed"] for r in rows), rows
    starts = [
        e
        for e in map(json.loads, (work / "run" / "events.jsonl").read_text().splitlines())
        if e["event"] == E.WORKER_START
    ]
    lost = starts[0]["nodes"][1]
    assert all(lost not in s["nodes"] for s in starts[1:]) and len(starts[-1]["nodes"]) == 2, starts
    assert res["data_and_params"]["hash_equal"] and not res["data_and_params"]["audit_problems"]
    print(log[log.index("  #") :])
