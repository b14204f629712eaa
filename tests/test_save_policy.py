"""When to save (trainer.ckpt.save_policy): steps, minutes, "auto" minutes derived from the measured stall,
the local tier's schedule, and which reason wins at one step. The clock is injected: no test sleeps."""

from __future__ import annotations

import math
import types

import pytest
from conftest import events, run_trainer

from trainer.ckpt.save_policy import AUTO_PRIOR_BLOCKING_S, Requests, Save, SavePolicy
from trainer.config import CheckpointConfig, ConfigError, load_config
from trainer.store import event_names as E
from trainer.survival.model import recommend_interval_min


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def policy(clock: Clock | None = None, *, steps: int = 100, stop_at: int = 100, **cfg) -> SavePolicy:
    return SavePolicy(
        CheckpointConfig(**cfg), steps=steps, stop_at=stop_at, devices=8, restart_s=60, clock=clock or Clock()
    )


def decide(
    p: SavePolicy, step: int, *, durable=False, local_timed=False, stop=False, asked="", hold=False, local=False
):
    agreed = Requests(durable=durable, local=local_timed)
    return p.decide(step, agreed=agreed, stop=stop, asked=asked, hold=hold, local=local)


def test_step_cadence_and_no_time_cadence_by_default():
    p = policy(every_steps=10)
    assert [decide(p, s) for s in (9, 10, 11, 20)] == [
        None,
        Save("durable", "periodic"),
        None,
        Save("durable", "periodic"),
    ]
    assert p.requests(local=False) == Requests() and p.saved(Save("durable", "periodic"), 0.5) is None


def test_which_reason_wins_and_a_hold_never_saves():
    p = policy(every_steps=10, local_every_steps=5, local_dir="/tmp/x")
    assert decide(p, 10, stop=True) == Save("durable", "preempt")
    assert decide(p, 100) == Save("durable", "final")
    assert decide(policy(stop_at=40), 40) == Save("durable", "stop")
    assert decide(p, 7, asked="ecc_rising") == Save("durable", "ecc_rising")
    assert decide(p, 7, durable=True) == Save("durable", "periodic")
    assert decide(p, 10, local=True) == Save("durable", "periodic")  # a durable save makes the local one redundant
    assert decide(p, 5, local=True) == Save("local", "local")
    assert decide(p, 5, local=False) is None  # the local tier failed in this attempt: no local save
    assert decide(p, 6, local=True, local_timed=True) == Save("local", "local")
    assert decide(p, 10, stop=True, hold=True) is None  # never save a spike's state


def test_time_cadences_fire_after_their_intervals_and_restart_on_a_save():
    clock = Clock()
    p = policy(clock, every_steps=0, every_minutes=2, local_every_minutes=0.5, local_dir="/tmp/x")
    assert p.requests(local=True) == Requests()
    clock.now += 30
    assert p.requests(local=True) == Requests(local=True) and p.requests(local=False) == Requests()
    p.saved(Save("local", "local"), 0.01)
    clock.now += 90
    assert p.requests(local=True) == Requests(durable=True, local=True)
    p.saved(Save("durable", "periodic"), 0.1)
    assert p.requests(local=True) == Requests(local=True)  # a durable save leaves the local schedule alone


def test_auto_interval_follows_the_measured_stall_and_cluster_size():
    cfg = dict(every_steps=0, every_minutes="auto", mtbf_hours=50000, auto_devices=1024)
    p = SavePolicy(CheckpointConfig(**cfg), steps=100, stop_at=100, devices=8, restart_s=120, clock=Clock())
    fast, slow = p.saved(Save("durable", "periodic"), 2.0), p.saved(Save("durable", "periodic"), 8.0)
    assert fast == recommend_interval_min(stall_s=2.0, restart_s=120, gpus=1024, mtbf_hours=50000)
    # Young: the interval grows with the square root of the stall.
    assert math.isclose(slow / fast, 2.0, rel_tol=0.05)
    assert p.minutes == slow and 10 < slow < 60


def test_auto_saves_before_any_save_was_measured():
    """every_minutes "auto" with every_steps 0 schedules timed saves from the start (it used to wait for a
    first measured save, which never came)."""
    clock = Clock()
    cfg = dict(every_steps=0, every_minutes="auto", mtbf_hours=2, auto_devices=1000)
    p = SavePolicy(CheckpointConfig(**cfg), steps=100, stop_at=100, devices=8, restart_s=10, clock=clock)
    first = recommend_interval_min(stall_s=AUTO_PRIOR_BLOCKING_S, restart_s=10, gpus=1000, mtbf_hours=2)
    assert p.minutes == first > 0
    assert p.requests(local=False) == Requests()
    clock.now += 60 * first
    assert p.requests(local=False) == Requests(durable=True)


def test_every_minutes_accepts_numbers_and_auto_only():
    assert load_config(None, ["checkpoint.every_minutes=auto"]).checkpoint.every_minutes == "auto"
    assert load_config(None, ["checkpoint.every_minutes=7.5"]).checkpoint.every_minutes == 7.5
    with pytest.raises(ConfigError, match="checkpoint.every_minutes"):
        load_config(None, ["checkpoint.every_minutes=often"])


@pytest.mark.slow
def test_auto_saves_periodically_in_a_real_run_priced_with_its_own_startup(tmp_path):
    """A worker with every_minutes "auto" and no step schedule saves on time before its final step, and the
    interval is priced with this attempt's measured start-up, not a fixed 60 s restart cost."""
    run = tmp_path / "run"
    run_trainer(
        run,
        "train.steps=24",
        "checkpoint.every_steps=0",
        "checkpoint.every_minutes=auto",
        "checkpoint.mtbf_hours=2",
        "checkpoint.auto_devices=1000",
        "faults=[{kind: slow, step: 1, seconds: 0.4, count: 24}]",
        worker=True,
    )
    ev = events(run)
    timed = [e["step"] for e in ev if e["event"] == E.CHECKPOINT_SAVED and e["reason"] == "periodic"]
    assert timed and max(timed) < 24, [(e["step"], e.get("reason")) for e in ev if e["event"] == E.CHECKPOINT_SAVED]
    startup = next(e["startup_s"] for e in ev if e["event"] == E.WORKER_READY)
    intervals = [e for e in ev if e["event"] == E.CHECKPOINT_INTERVAL]
    assert intervals and all(e["restart_s"] == startup for e in intervals), intervals


def test_the_loop_asks_the_time_cadence_at_every_step(tmp_path):
    """The loop's per-step save decision (trainer.train.loop._agree, on a real checkpoint tier and agreement)
    consults the clock: every_minutes=1 with no step schedule saves at the first step a minute after the
    start or the last save, at no step before, whatever the step number."""
    from trainer.ckpt import tiers
    from trainer.parallel import agree
    from trainer.train import loop
    from trainer.train.flags import Flags, Shared

    clock = Clock()
    cfg = CheckpointConfig(every_steps=0, every_minutes=1)
    p = SavePolicy(cfg, steps=100, stop_at=100, devices=8, restart_s=60, clock=clock)
    ckpt = tiers.Tiers(tmp_path, cfg, log=lambda *a, **f: None, pinned=None, rewinds=[])
    w = types.SimpleNamespace(ckpt=ckpt)  # _agree reads only the worker's checkpoint tiers
    group, flags = agree.Agreement(Shared, processes=1, start=0), Flags()
    try:
        decided = []
        for step, seconds in ((1, 30), (2, 29), (3, 1), (4, 0), (5, 59), (6, 1)):
            clock.now += seconds
            save = loop._agree(w, flags, group, p, step)[1]
            decided.append(save)
            if save is not None:
                p.saved(save, 0.1)  # what the loop's _checkpoint tells the policy once the save started
        assert decided == [None, None, Save("durable", "periodic"), None, None, Save("durable", "periodic")], decided
    finally:
        ckpt.close()
