"""Checkpoint cadence: steps, minutes, and "auto" minutes derived from the measured stall."""

from __future__ import annotations

import math

import pytest

from trainer.config import CheckpointConfig, ConfigError, load_config
from trainer.core.checkpoint import SavePolicy
from trainer.survival.model import recommend_interval_min


def test_step_cadence_and_no_time_cadence_by_default():
    policy = SavePolicy(CheckpointConfig(every_steps=10), devices=8, restart_s=60)
    assert [policy.due(s)[0] for s in (9, 10, 11, 20)] == [False, True, False, True]
    assert policy.due(10)[1] is False and policy.saved(0.5) is None


def test_auto_interval_follows_the_measured_stall_and_cluster_size():
    cfg = CheckpointConfig(every_steps=0, every_minutes="auto", mtbf_hours=50000, auto_devices=1024)
    policy = SavePolicy(cfg, devices=8, restart_s=120)
    fast, slow = policy.saved(2.0), policy.saved(8.0)
    assert fast == recommend_interval_min(stall_s=2.0, restart_s=120, gpus=1024, mtbf_hours=50000)
    # Young: the interval grows with the square root of the stall.
    assert math.isclose(slow / fast, 2.0, rel_tol=0.05)
    assert policy.minutes == slow and 10 < slow < 60


def test_every_minutes_accepts_numbers_and_auto_only():
    assert load_config(None, ["checkpoint.every_minutes=auto"]).checkpoint.every_minutes == "auto"
    assert load_config(None, ["checkpoint.every_minutes=7.5"]).checkpoint.every_minutes == 7.5
    with pytest.raises(ConfigError, match="checkpoint.every_minutes"):
        load_config(None, ["checkpoint.every_minutes=often"])


def test_time_cadence_fires_after_the_interval():
    import time

    policy = SavePolicy(CheckpointConfig(every_steps=0, every_minutes=0.002), devices=1, restart_s=60)
    assert policy.due(1) == (False, False)
    time.sleep(0.15)
    assert policy.due(2) == (False, True)
    policy.saved(0.1)
    assert policy.due(3) == (False, False)
