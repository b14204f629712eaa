"""The rules behind the downtime of a failure, unit by unit: when the supervisor calls a process frozen from the
pulses (trainer.supervise.hang.pulses), and how a failure's seconds are split into parts
(trainer.observe.downtime). The end-to-end proof that a frozen process is named in seconds and that each
restart's parts add up to its kill-to-first-step is tests/test_multihost.py's kill-and-hang test; the numbers
per failure kind are benchmarks/downtime.py's."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from trainer.config import Phase
from trainer.observe import downtime
from trainer.observe.heartbeat import PULSE_FRESH_S, PULSE_S, PULSE_STALE_S, Beat, Pulse
from trainer.supervise import hang

NOW = 1000.0


def pulse(age: float, **more) -> Pulse:
    return Pulse(NOW - age, 1, "x", **more)


def test_a_frozen_process_is_named_only_while_a_peer_is_alive():
    stale, fresh = PULSE_STALE_S + 0.5, PULSE_FRESH_S / 2
    v = hang.pulses([pulse(fresh), pulse(stale)], NOW)
    assert (v.frozen, round(v.frozen_s, 3), v.live_max_s) == (1, stale, fresh)
    # The oldest of several stopped pulses is the one named (the first to stop).
    assert hang.pulses([pulse(stale + 3), pulse(fresh), pulse(stale)], NOW).frozen == 0
    # No verdict: every pulse old (a stalled shared disk, a suspended machine: the hang timeouts judge that).
    assert hang.pulses([pulse(stale), pulse(stale + 1)], NOW).frozen is None
    # ... nor with a peer alive but not fresh (it may be the disk that lags for everyone).
    assert hang.pulses([pulse(PULSE_FRESH_S + 0.5), pulse(stale)], NOW).frozen is None
    # ... nor for a process leaving on purpose, nor one that has not pulsed yet (still starting).
    assert hang.pulses([pulse(fresh), pulse(stale, ending=True)], NOW).frozen is None
    assert hang.pulses([pulse(fresh), None], NOW).frozen is None
    # Just under the line: no verdict, and the margin is what the supervisor records.
    v = hang.pulses([pulse(fresh), pulse(PULSE_STALE_S - 0.1)], NOW)
    assert v.frozen is None and round(v.live_max_s, 3) == PULSE_STALE_S - 0.1


def test_a_hang_is_blamed_on_the_process_whose_pulse_stopped_else_the_one_furthest_behind():
    """At the step timeout (the frozen check did not fire: no peer's pulse was fresh enough): a process whose
    pulse stopped is blamed, even when its waiting peer's heartbeat is further behind; with every process
    pulsing (a stuck kernel), the one furthest behind."""
    now = time.time()
    beats = [hang.Standing(0, Phase.STEP, now - 30, 40), hang.Standing(1, Phase.STEP, now - 20, 41)]  # 0 behind
    hbs = [Beat(Phase.STEP, 40, now - 30, node="n0"), Beat(Phase.STEP, 41, now - 20, node="n1")]
    slow_peer = Pulse(now - (PULSE_FRESH_S + PULSE_STALE_S) / 2)  # alive, not fresh: no frozen verdict
    stopped = Pulse(now - PULSE_STALE_S - 5)
    assert hang.pulses([slow_peer, stopped], now).frozen is None
    i, node, why = hang.hung_on(beats, hbs, (slow_peer, stopped))
    assert (i, node) == (1, "n1") and "froze" in why, why
    i, node, why = hang.hung_on(beats, hbs, (Pulse(now), Pulse(now)))
    assert (i, node) == (0, "n0") and "furthest behind" in why, why


def test_the_parts_of_a_downtime_add_up_to_the_failure_to_first_step_and_are_never_negative():
    marks = {m: 10.0 + i for i, m in enumerate(downtime.MARKS)}
    marks["stepped"] = 20.5
    secs = downtime.parts(marks)
    assert list(secs) == list(downtime.PARTS) and secs["first_step"] == 3.5
    assert sum(secs.values()) == marks["stepped"] - marks["failed"]
    # A boundary read on another machine's clock, earlier than the one before it: its part is 0, not negative,
    # and the next part takes the difference; the total is unchanged.
    skewed = dict(marks, started=marks["launched"] - 0.3)
    s2 = downtime.parts(skewed)
    assert s2["launch"] == 0 and s2["init"] == marks["restoring"] - marks["launched"]
    assert sum(s2.values()) == sum(secs.values())
    # An attempt that failed again before its first step: the outage counts from the first failure.
    fields = downtime.event_fields(dict(since=4.0, failed=10.0, noticed=11.0, down=12.0, reason="hang"), marks)
    assert fields["failed_attempts_s"] == 6.0 and fields["total_s"] == 16.5, fields


def test_when_a_failure_happened_comes_from_the_first_cause_seen_else_the_stopped_pulse():
    # A process seen leaving by itself: then (the supervisor polls every few tens of ms).
    assert downtime.failed_at([pulse(3), pulse(0.2)], NOW - 0.1, NOW) == NOW - 0.1
    # Only survivors' reactions seen (a lost node reports nothing): the oldest stopped pulse, plus half a pulse
    # period; a process that left on purpose does not count; never after it was noticed.
    ps = [pulse(3), pulse(0.9), pulse(9, ending=True)]
    assert downtime.failed_at(ps, 0.0, NOW) == NOW - 3 + PULSE_S / 2
    assert downtime.failed_at([pulse(0.1)], 0.0, NOW - 1) == NOW - 1
    assert downtime.failed_at([None], 0.0, NOW) == NOW


def test_a_process_knows_when_it_started():
    """The `launch` part ends when the new process started: the kernel's record, not when Python got going."""
    late = 0.3  # a process that takes this long to get going (imports) before it asks
    code = f"import time; time.sleep({late}); from trainer.observe import downtime; "
    code += "print(time.time() - downtime.process_start())"
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ)
    since_start = float(out.stdout)
    assert late - 0.02 < since_start < time.time() - t0 + 0.02, (since_start, time.time() - t0)


def test_a_standby_that_died_is_replaced_by_a_cold_start(tmp_path):
    """A standby process that died (killed, out of memory) before or while it is handed its attempt: the attempt
    starts cold, never on a dead process, and the supervisor does not fail on the broken pipe."""
    from trainer.supervise import launcher, standby

    argv = [sys.executable, "-c", "import sys; sys.stdin.readline()"]
    s = standby.Standby(argv, os.environ, processes=1, cpus=[()], run_dir=tmp_path)
    s.procs[0].kill()
    s.procs[0].wait()
    assert s.go([dict(os.environ)]) == []  # the pipe is broken: no attempt on it
    dead = s.procs[0].pid
    g = launcher.LocalGroup(argv, os.environ, processes=1, port=1, grace_s=1.0, standby=s)
    assert g.procs[0].pid != dead and g.standby == "", (g.procs[0].pid, dead, g.standby)
    g.send_signal(9)
    g.wait(timeout=30)
