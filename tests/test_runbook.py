"""The spike runbook's decision logic on synthetic metric streams: detection, probing, history after a
restart, retention pins, escalation (skip -> soften -> give up), rewinds and the recorded state."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from trainer.config import Config, ConfigError, Fault, RunbookConfig, load_config
from trainer.faults.injector import FaultInjector
from trainer.observe import events, spikes
from trainer.store import event_names as E
from trainer.supervise import runbook
from trainer.train.data import batch_index

DATA = Path(__file__).parent / "data"


def _cfg(**kw) -> RunbookConfig:
    return RunbookConfig(**{"window": 32, "warmup_steps": 20, "min_history": 8, "probe_steps": 4, **kw})


def _detector(
    cfg: RunbookConfig | None = None,
    *,
    stop_step: int = 10_000,
    events_path: Path | None = None,
    skips: tuple[int, ...] = (),
):
    logged = []
    det = spikes.SpikeDetector(
        cfg or _cfg(),
        log=lambda event, **f: logged.append({"event": event, **f}),
        batch_of=lambda s: batch_index(s - 1, list(skips)),
        stop_step=stop_step,
        events_path=events_path,
    )
    return det, logged


def _stream(n: int, *, seed: int = 0, flat: bool = False):
    """A healthy run: loss falling fast then flattening, heavy-ish tailed grad norms (flat: a quiet plateau)."""
    rng = random.Random(seed)
    for step in range(1, n + 1):
        if flat:
            loss, gn = 2.0 + rng.gauss(0, 0.01), math.exp(rng.gauss(0, 0.05))
        else:
            loss = 2.0 + 4.0 * math.exp(-step / 15) + rng.gauss(0, 0.03)
            gn = (1.0 + 6.0 * math.exp(-step / 5)) * math.exp(rng.gauss(0, 0.15))
        yield step, {"loss": loss, "grad_norm": gn, "update_norm": 0.3}


def _feed(det, stream) -> list[tuple[int, dict]]:
    return [(step, a) for step, rec in stream if (a := det.on_step(step, rec)) is not None]


def test_a_healthy_run_with_its_fast_early_drop_never_fires():
    det, logged = _detector(RunbookConfig())  # the defaults
    assert _feed(det, _stream(2000)) == [] and logged == []


@pytest.mark.parametrize("name", ["tiny_clean_shuffled", "tiny_clean_sequential"])
def test_recorded_clean_tiny_runs_never_fire_with_the_defaults(name):
    """Real loss / grad-norm streams of clean 300-step tiny runs (one with a lone 3.3x grad-norm blip)."""
    recs = json.loads((DATA / f"{name}.json").read_text())
    det, logged = _detector(RunbookConfig())
    assert _feed(det, ((r["step"], r) for r in recs)) == [] and logged == []


def test_a_loss_jump_holds_then_reports_the_offending_span():
    det, logged = _detector(skips=(3,))
    stream = list(_stream(60))
    for step in (41, 42, 43):  # three bad batches in a row
        stream[step - 1][1]["loss"] = 7.5
    actions = _feed(det, stream)
    assert [a["do"] for _, a in actions] == ["hold", "spike"]
    assert actions[0][0] == 41 and actions[1][0] == 44  # held at the first, ended at the first clean one
    spike = actions[1][1]
    assert (spike["began"], spike["end"], spike["open"], spike["signal"]) == (41, 43, False, "loss")
    assert spike["batches"] == [41, 42, 43]  # steps 41..43 read batches 40..42, shifted by the earlier skip
    assert logged[0]["event"] == E.SPIKE_DETECTED and logged[0]["value"] == 7.5
    assert logged[0]["threshold"] < 7.5 and logged[0]["sigma"] > 6


def test_a_lone_grad_norm_blip_is_not_a_spike_but_a_sustained_rise_is():
    det, _ = _detector()
    stream = list(_stream(80))
    stream[49][1]["grad_norm"] = 5.0  # one 5x blip: clipping absorbs it
    for step in (70, 71):
        stream[step - 1][1]["grad_norm"] = 8.0
    actions = _feed(det, stream[:72])
    assert [(s, a["do"]) for s, a in actions] == [(71, "hold"), (72, "spike")]
    assert actions[0][1]["reason"] == "grad_norm"
    assert (actions[1][1]["began"], actions[1][1]["end"]) == (70, 71)  # the first high step is where it began


def test_elevated_steps_before_the_spike_are_where_it_began():
    det, logged = _detector()
    stream = list(_stream(60, flat=True))  # bars: loss onset 2.1, spike 2.2; grad norm onset 1.5, spike 2.0
    stream[38][1]["grad_norm"] = 1.8  # step 39: above the onset bar, below the spike bar
    stream[39][1]["loss"] = 2.15  # step 40: the same for the loss
    stream[40][1]["loss"] = 8.0
    actions = _feed(det, stream)
    assert logged[0]["began"] == 39 and actions[-1][1]["began"] == 39 and actions[-1][1]["end"] == 41


def test_nan_fires_at_once_even_in_warmup_without_probing():
    det, logged = _detector()
    stream = list(_stream(10))
    stream[4][1]["update_norm"] = math.nan  # the update at step 5 made the params NaN
    actions = _feed(det, stream)
    assert len(actions) == 1
    step, a = actions[0]
    assert step == 5 and a["do"] == "spike" and a["signal"] == "nonfinite_update_norm"
    assert (a["began"], a["end"], a["batches"], a["probed"]) == (5, 5, [4], 0)


def test_the_loop_keeps_the_first_spike_while_the_group_agrees_to_exit():
    """With several processes the group leaves a few steps after a spike (the agreement lags), and every step
    after a NaN update is NaN: the detector reports the spike once, so the runbook gets its span, the offending
    batch, not a later one (seen with 2 processes: batch 24 skipped for a NaN of batch 22)."""
    from trainer.train.flags import Flags

    det, _ = _detector()
    stream = list(_stream(10))
    stream[4][1]["update_norm"] = math.nan  # the update at step 5 made the params NaN...
    for _, rec in stream[5:]:
        rec["loss"] = math.nan  # ... and every step after it computes a NaN loss
    flags = Flags()
    for step, action in _feed(det, stream):
        flags.act(step, action)
    assert (flags.spike["step"], flags.spike["began"], flags.spike["batches"]) == (5, 5, [4]), flags.spike


def test_probing_that_never_finds_a_clean_batch_reports_an_open_span():
    det, _ = _detector(_cfg(probe_steps=3))
    stream = list(_stream(60))
    for step in range(41, 60):
        stream[step - 1][1]["loss"] = 9.0  # a broken model: every batch looks bad
    step, spike = next((s, a) for s, a in _feed(det, stream) if a["do"] == "spike")
    assert step == 44 and spike["open"] is True and spike["end"] == 44


def test_a_spike_in_the_last_steps_ends_the_probe_at_the_stop_step():
    det, _ = _detector(stop_step=42)
    stream = list(_stream(42))
    stream[40][1]["loss"] = stream[41][1]["loss"] = 8.0
    actions = _feed(det, stream)
    assert [(s, a["do"]) for s, a in actions] == [(41, "hold"), (42, "spike")] and actions[1][1]["end"] == 42


def test_a_nan_while_probing_ends_the_probe_with_the_span_seen_so_far():
    det, _ = _detector()
    stream = list(_stream(50))
    stream[40][1]["loss"] = 8.0
    stream[41][1]["loss"] = math.nan
    actions = _feed(det, stream)
    assert actions[-1][0] == 42 and actions[-1][1]["end"] == 41


def _write_events(path: Path, records: list[dict]) -> None:
    with open(path, "w") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")


def test_a_restarted_detector_judges_against_the_history_before_it(tmp_path):
    """Restarted at step 40 (a rewind), it must catch a spike at step 42 with no warm-up of its own, from
    the latest record of each step <= 40 (a recomputed step counts once)."""
    stream = list(_stream(60))
    old = [{"event": E.STEP, "step": s, **r} for s, r in stream[:45]]
    old += [
        {"event": E.STEP, "step": s, "loss": 99.0, "grad_norm": 99.0, "update_norm": 0.3} for s in range(41, 45)
    ]  # the rewound trajectory: after step 40, never used
    old.insert(10, {"event": E.CHECKPOINT_SAVED, "step": 10})
    _write_events(tmp_path / "events.jsonl", old)
    with open(tmp_path / "events.jsonl", "a") as fh:
        fh.write('{"event": "step", "step": 3, "lo')  # torn by a kill
    fresh, _ = _detector(_cfg(min_history=32))
    primed, _ = _detector(_cfg(min_history=32), events_path=tmp_path / "events.jsonl")
    stream[41][1]["loss"] = 8.0
    assert _feed(fresh, stream[40:]) == []  # no history of its own yet
    assert _feed(primed, stream[40:])[0][0] == 42


def test_recent_steps_reads_backwards_across_blocks(tmp_path, monkeypatch):
    recs = [{"event": E.STEP, "step": s, "loss": float(s), "pad": "x" * 50} for s in range(1, 101)]
    _write_events(tmp_path / "e.jsonl", recs)
    lines = list(events._lines_backwards(tmp_path / "e.jsonl", block=37))
    assert [json.loads(x)["step"] for x in lines] == list(range(100, 0, -1))
    got = spikes.recent_steps(tmp_path / "e.jsonl", upto=70, n=5)
    assert [r["step"] for r in got] == [66, 67, 68, 69, 70]


def test_retention_pins_keep_the_last_known_good_and_the_rewind_target():
    assert runbook.retention_pins([50, 100, 150, 200, 250], window=128, pinned=[]) == {100, 150}
    assert runbook.retention_pins([50, 100], window=128, pinned=[40]) == {40, 50}
    assert runbook.retention_pins([10, 20, 30], window=None, pinned=[10]) == {10}
    assert runbook.retention_pins([], window=8, pinned=[]) == set()


def test_with_keep_latest_1_a_checkpoint_older_than_the_window_always_survives():
    kept: list[int] = []
    for step in range(10, 500, 10):  # a save every 10 steps, retention applied after each like Orbax does
        kept.append(step)
        keep = runbook.retention_pins(kept, window=16, pinned=[]) | {step}
        kept = [s for s in kept if s in keep]
        if step - 16 >= 10:  # from when the first checkpoint is that old
            assert any(s <= step - 16 for s in kept), (step, kept)
        assert len(kept) <= 3


def _spike(began: int, **kw) -> dict:
    return {"began": began, "end": began, "batches": [began - 1], "step": began, **kw}


def test_escalation_skip_then_soften_on_recurrence_then_give_up():
    rc = RunbookConfig(recur_distance=50, max_actions=3)
    h = []
    assert runbook.decide(h, _spike(100), rc) == "skip"
    h.append({"action": "skip", **_spike(100)})
    assert runbook.decide(h, _spike(400), rc) == "skip"  # far away: another bad batch, not a recurrence
    assert runbook.decide(h, _spike(130), rc) == "soften"
    h.append({"action": "soften", **_spike(130)})
    assert runbook.decide(h, _spike(170), rc) == "soften"  # near the soften: soften more
    h.append({"action": "soften", **_spike(170)})
    assert runbook.decide(h, _spike(900), rc) == "give_up"


def _run_dir(tmp_path: Path, ckpts: list[int], spike: dict) -> Path:
    run = tmp_path / "run"
    for s in ckpts:
        (run / "checkpoints" / str(s)).mkdir(parents=True)
        (run / "checkpoints" / str(s) / "marker").write_text(str(s))
    (run / "checkpoints" / "61.orbax-checkpoint-tmp-1").mkdir()
    _write_events(run / "events.jsonl", [{"event": E.WORKER_START}, {"event": E.SPIKE_EXIT, **spike}])
    return run


def test_respond_rewinds_skips_and_records_everything(tmp_path, monkeypatch):
    cfg = Config()
    run = _run_dir(
        tmp_path,
        [20, 40, 60],
        dict(_spike(41, end=43, batches=[40, 41, 42], step=44), signal="loss", value=7.8, threshold=3.9, open=False),
    )
    # The new skip list may be written only once the spiked checkpoints are out of the way: a kill right
    # after it is written must not leave it next to a checkpoint that already trained on the spike (a kill
    # before it is harmless: the old skips and the old checkpoint replay the spike and the runbook runs again).
    at_save, save = [], runbook.RunbookState.save
    monkeypatch.setattr(
        runbook.RunbookState,
        "save",
        lambda self, d: (
            at_save.append(sorted(p.name for p in (d / "checkpoints").iterdir() if p.name.isdigit())),
            save(self, d),
        )[1],
    )
    written = []
    out = runbook.respond(run, cfg, lambda event, **f: written.append({"event": event, **f}))
    assert at_save == [["20", "40"]], at_save
    assert out.action == "skip" and "skipped batches 40-42" in out.message
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["20", "40"]
    assert (run / "rewound" / "60-1" / "marker").read_text() == "60"
    state = json.loads((run / "runbook.json").read_text())
    assert state["skips"] == [40, 41, 42] and state["pinned"] == [40] and state["lr_scale"] == 1.0
    kinds = {e["event"]: e for e in written}
    assert kinds[E.REWIND]["from"] == 44 and kinds[E.REWIND]["to"] == 40 and kinds[E.REWIND]["moved"] == [60]
    b = cfg.data.batch_size
    assert kinds[E.SKIP]["batches"] == [40, 41, 42] and kinds[E.SKIP]["samples"] == [[40 * b, 43 * b - 1]]
    assert kinds[E.SKIP]["steps"] == [41, 43]
    assert list((run / "tb").iterdir())  # the TensorBoard marker


def test_respond_softens_on_recurrence_and_gives_up_saying_what_it_tried(tmp_path):
    cfg = Config()
    cfg.runbook.max_actions = 2
    cfg.runbook.b2 = 0.9
    run = _run_dir(tmp_path, [20], dict(_spike(25, step=27), signal="loss", value=17.0, threshold=4.0, open=True))
    state = runbook.RunbookState.load(run, cfg.optim)
    state.skips, state.history = (
        [17],
        [
            {
                "action": "skip",
                "n": 1,
                "from": 20,
                "to": 10,
                **_spike(18),
                "signal": "loss",
                "value": 68.0,
                "threshold": 5.9,
                "open": True,
            }
        ],
    )
    state.save(run)
    written = []
    out = runbook.respond(run, cfg, lambda event, **f: written.append({"event": event, **f}))
    assert out.action == "soften"
    state = json.loads((run / "runbook.json").read_text())
    assert (state["lr_scale"], state["clip_norm"], state["b2"], state["skips"]) == (0.5, 0.5, 0.9, [17])
    soften = next(e for e in written if e["event"] == E.SOFTEN)
    assert soften["lr_scale"] == 0.5 and soften["clip_norm"] == 0.5 and soften["peak_lr"] == cfg.optim.lr / 2
    # What every later worker start reads back and sets in the optimizer state it restored or initialised
    # (trainer.train.loop), and the config it records.
    hyperparams = runbook.RunbookState.load(run, cfg.optim).hyperparams()
    assert hyperparams == {"lr_scale": 0.5, "clip_norm": 0.5, "b2": 0.9}, hyperparams
    softened = runbook.softened_config(cfg, runbook.RunbookState.load(run, cfg.optim))
    assert (softened.optim.lr, softened.optim.clip_norm, softened.optim.b2) == (cfg.optim.lr / 2, 0.5, 0.9)

    _write_events(
        run / "events.jsonl",
        [
            {"event": E.WORKER_START},
            {
                "event": E.SPIKE_EXIT,
                **_spike(26, step=28),
                "signal": "nonfinite_loss",
                "value": math.nan,
                "threshold": None,
                "open": False,
            },
        ],
    )
    out = runbook.respond(run, cfg, lambda event, **f: written.append({"event": event, **f}))
    assert out.action == "give_up"
    assert "gave up after 2 actions" in out.message and "skipped batches 17" in out.message
    assert "softened: LR scale 0.5" in out.message
    assert written[-1]["event"] == E.RUNBOOK_GAVE_UP and len(written[-1]["tried"]) == 2


def test_a_spike_exit_code_without_a_spike_event_gives_up(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    _write_events(run / "events.jsonl", [{"event": E.SPIKE_EXIT, **_spike(5)}, {"event": E.WORKER_START}])
    assert runbook.respond(run, Config(), lambda *a, **k: None).action == "give_up"


def test_sample_ranges_merge_contiguous_batches():
    assert runbook.sample_ranges([3, 1, 2, 7], 4) == [[4, 15], [28, 31]]


@pytest.mark.parametrize(
    "bad, match",
    [
        ("runbook.lr_factor=2", "lr_factor"),
        ("runbook.window=0", "window"),
        ("runbook.b2=1.5", "b2"),
        ("runbook.min_history=500", "min_history"),
        ("runbook.onset_sigma=9", "onset_sigma"),
    ],
)
def test_bad_runbook_settings_are_config_errors(bad, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [bad])


def test_nan_and_spike_faults_poison_one_update_once_or_on_every_attempt(tmp_path):
    faults = [Fault(kind="nan", step=3), Fault(kind="spike", step=5, scale=10.0, repeat=True)]
    inj = FaultInjector(faults, tmp_path)
    assert [inj.lr_scale(s, 0.5) for s in (2, 4, 5)] == [0.5, 0.5, 5.0]
    assert math.isnan(inj.lr_scale(3, 0.5)) and inj.lr_scale(3, 0.5) == 0.5  # fired, recorded
    again = FaultInjector(faults, tmp_path)  # the next attempt
    assert again.lr_scale(3, 0.5) == 0.5 and again.lr_scale(5, 0.5) == 5.0


def test_a_fault_fires_on_its_own_process_and_no_process_drops_another_ones_record(tmp_path):
    faults = [Fault("ecc", 2, count=5, process=1), Fault("nan", 3, process=1), Fault("slow", 4)]
    p0, p1 = FaultInjector(faults, tmp_path, process=0), FaultInjector(faults, tmp_path, process=1)
    fired = lambda: json.loads((tmp_path / "faults_fired.json").read_text())  # noqa: E731
    p0.before_step(2)  # process 1's: not fired here
    assert p0.ecc_errors(2) == 0 and not (tmp_path / "faults_fired.json").exists()
    p1.before_step(2)
    assert p1.ecc_errors(2) == 5 and fired() == [0]
    assert math.isnan(p0.lr_scale(3, 0.5))  # the state-changing kinds apply on every process ...
    assert fired() == [0]  # ... and their own process records them
    assert math.isnan(p1.lr_scale(3, 0.5)) and fired() == [0, 1]
    p0.before_step(4)  # process 0 read the file before process 1 wrote it: it must keep what is there
    assert fired() == [0, 1, 2]
    assert FaultInjector(faults, tmp_path, process=1).lr_scale(3, 0.5) == 0.5  # the next attempt: fired


def _mismatch(run: Path, odd_processes: list[int], replicas: int) -> None:
    """What a worker writes when a replica check fails (the shape trainer.train.replicas.check returns)."""
    devices = [
        {
            "device": 2048 * r,
            "process": r,
            "data": r,
            "fsdp": 0,
            "tensor": 0,
            "fingerprint": 7,
            "odd": r in odd_processes,
        }
        for r in range(replicas)
    ]
    log = events.EventLog(run / "events.jsonl")
    log.write(E.WORKER_START, pid=1)
    log.write(E.REPLICA_MISMATCH, step=8, last_good=4, param="['wte']['embedding']", devices=devices)


def test_a_diverged_replica_blames_its_node_only_when_the_others_outvote_it(tmp_path):
    from trainer.supervise import replica_rewind

    written = []
    _mismatch(tmp_path, [3], replicas=4)  # one copy of four differs: its process's node is the suspect
    line, culprit = replica_rewind.rewind(tmp_path, lambda *a, **k: written.append(k), tag=1, nodes=list("abcd"))
    assert culprit[0] == "d" and "process 3" in culprit[1] and written[-1]["node"] == "d", (culprit, written)
    assert "silent data corruption" in line
    _mismatch(tmp_path, [0, 1], replicas=2)  # two copies disagree: either may be the bad one, blame neither
    line, culprit = replica_rewind.rewind(tmp_path, lambda *a, **k: written.append(k), tag=2, nodes=list("ab"))
    assert culprit is None and "node" not in written[-1], written[-1]
