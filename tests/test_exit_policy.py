"""The supervisor's exit policy, row by row: for each exit code, exit_codes.decide() gives its row's action, and
the counters' edges (a crash loop, the restart budget, the backoff) fall where the config says. And the
supervisor reads the heartbeats once per poll, a hang included. No worker runs here: fast."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time

import pytest
from conftest import ROOT

from trainer.config import SupervisorConfig, load_config
from trainer.observe import heartbeat
from trainer.store import rundir
from trainer.supervise import after_exit, group, supervisor
from trainer.supervise import exit_codes as ec

SC = SupervisorConfig(max_restarts=5, crash_loop_restarts=3, backoff_s=1.0, backoff_max_s=3.0)

# code -> (do, supervisor exit code, remedy, fails_as, reason): an attempt that ended so, at a new step, with
# nothing asked of it.
ROWS = {
    ec.OK: (ec.FINISH, ec.OK, "", None, ""),
    ec.CONFIG: (ec.STOP, ec.CONFIG, "", None, ""),
    ec.LOCKED: (ec.RESTART, None, "", None, "exit code 73"),
    ec.PREEMPTED: (ec.REQUEUE, ec.PREEMPTED, "", None, ""),
    ec.CRASH_LOOP: (ec.RESTART, None, "", None, "exit code 76"),
    ec.RESTART_BUDGET: (ec.RESTART, None, "", None, "exit code 77"),
    ec.SPIKE: (ec.RESUME, None, ec.RUNBOOK, ec.RUNBOOK_GAVE_UP, ""),
    ec.RUNBOOK_GAVE_UP: (ec.RESTART, None, "", None, "exit code 79"),
    ec.REPLICA_MISMATCH: (ec.RESTART, None, ec.REWIND_REPLICAS, None, "replica mismatch"),
    ec.STORAGE: (ec.RESTART, None, ec.WAIT_FOR_ROOM, ec.STORAGE, "disk full"),
    ec.PEER_LOST: (ec.RESTART, None, "", None, "exit code 82"),
    -signal.SIGABRT: (ec.RESTART, None, "", None, "signal SIGABRT"),
    13: (ec.RESTART, None, "", None, "exit code 13"),  # no row: a crash
    -signal.SIGKILL: (ec.RESTART, None, "", None, "signal SIGKILL"),
    -signal.SIGSEGV: (ec.RESTART, None, "", None, "signal SIGSEGV"),
}


def _decide(code: int, **what) -> ec.Decision:
    return ec.decide(ec.Exited(code, what.pop("step", 7), **what), ec.Tally(), SC)


@pytest.mark.parametrize("code", ROWS, ids=lambda c: ec.NAMES.get(c, str(c)))
def test_each_exit_code_gets_its_rows_action(code):
    do, exit_code, remedy, fails_as, reason = ROWS[code]
    d = _decide(code)
    assert (d.do, d.code, d.remedy, d.fails_as, d.reason) == (do, exit_code, remedy, fails_as, reason), d
    restarts = 1 if do == ec.RESTART else 0  # only a failure counts, and it restarts at once at a new step
    assert d.tally.restarts == restarts and d.backoff_s == 0.0, d


def test_every_row_is_walked_and_the_launchers_columns_are_the_ones_they_had():
    assert set(ec.POLICY) <= set(ROWS)
    assert ec.CHOSEN == {ec.OK, ec.CONFIG, ec.PREEMPTED, ec.SPIKE, ec.REPLICA_MISMATCH, ec.STORAGE}
    assert ec.PEERS_FOLLOW == {ec.OK, ec.PREEMPTED, ec.SPIKE, ec.REPLICA_MISMATCH}
    assert ec.CONSEQUENCES == {ec.PEER_LOST, -signal.SIGABRT}
    assert ec.NAMES[ec.RESTART_BUDGET] == "restart budget spent" and -signal.SIGABRT not in ec.NAMES


def test_what_the_supervisor_asked_for_or_was_told_overrides_the_row():
    assert _decide(ec.CONFIG, accepted=False).do == ec.REFUSED  # no worker ever accepted it: leave no trace
    assert (_decide(ec.PREEMPTED, draining=True).do, _decide(ec.PREEMPTED, draining=True).remedy) == (
        ec.RESUME,
        ec.DRAIN,
    )
    assert _decide(ec.PREEMPTED, regrowing=True).remedy == ec.REGROW
    assert _decide(ec.PREEMPTED, draining=True, regrowing=True).remedy == ec.DRAIN
    # Told to stop: every exit but a finished run (and a config never accepted) asks for a requeue.
    for code in (ec.PREEMPTED, ec.CONFIG, ec.SPIKE, ec.STORAGE, 13, -signal.SIGKILL):
        d = _decide(code, stopping=True, draining=True)
        assert (d.do, d.code, d.tally) == (ec.REQUEUE, ec.PREEMPTED, ec.Tally()), (code, d)
    assert _decide(ec.OK, stopping=True).do == ec.FINISH
    assert _decide(ec.CONFIG, stopping=True, accepted=False).do == ec.REFUSED
    assert _decide(13, hung=True).reason == "hang" and _decide(ec.STORAGE, hung=True).reason == "disk full"


def _run(codes_steps, **what) -> list[ec.Decision]:
    out, tally = [], ec.Tally()
    for code, step in codes_steps:
        out.append(ec.decide(ec.Exited(code, step, **what), tally, SC))
        tally = out[-1].tally
    return out


def test_the_same_step_failing_crash_loop_restarts_times_gives_up_with_backoff_before():
    ds = _run([(13, 12)] * 3)
    assert [(d.do, d.backoff_s) for d in ds] == [(ec.RESTART, 0.0), (ec.RESTART, 1.0), (ec.GIVE_UP, 0.0)]
    assert (ds[-1].code, ds[-1].reason, ds[-1].tally.restarts) == (ec.CRASH_LOOP, "exit code 13", 2)
    # Failures before the first step (no heartbeat: step None) are at the same step too.
    assert _run([(13, None)] * 3)[-1].code == ec.CRASH_LOOP
    # A failure at another step starts the count over, and restarts at once.
    ds = _run([(13, 12), (13, 12), (13, 13), (13, 13)])
    assert [d.do for d in ds] == [ec.RESTART] * 4 and [d.backoff_s for d in ds] == [0.0, 1.0, 0.0, 1.0]
    assert ds[-1].tally == ec.Tally(restarts=4, same_step=2, fail_step=13)


def test_the_restart_budget_and_the_bounded_doubling_backoff():
    sc = SupervisorConfig(max_restarts=4, crash_loop_restarts=10, backoff_s=0.2, backoff_max_s=0.5)
    tally, ds = ec.Tally(), []
    for _ in range(5):
        ds.append(ec.decide(ec.Exited(13, 0), tally, sc))
        tally = ds[-1].tally
    assert [d.backoff_s for d in ds[:4]] == [0.0, 0.2, 0.4, 0.5]
    assert (ds[-1].do, ds[-1].code, ds[-1].tally.restarts) == (ec.GIVE_UP, ec.RESTART_BUDGET, 4)


def test_an_srun_step_that_never_started_backs_off_but_is_no_crash_loop():
    ds = _run([(1, 12)] * 4, blocked=True)
    assert [d.do for d in ds] == [ec.RESTART] * 4 and [d.reason for d in ds] == ["step could not start"] * 4
    assert [d.backoff_s for d in ds] == [1.0, 2.0, 3.0, 3.0]  # from the first: it ran nothing
    assert ds[-1].tally == ec.Tally(restarts=4, blocked=4)
    after = ec.decide(ec.Exited(13, 12), ds[-1].tally, SC)  # a real failure then counts from one
    assert (after.backoff_s, after.tally.same_step, after.tally.blocked) == (0.0, 1, 0)


def test_the_job_script_requeues_exactly_the_codes_whose_row_says_so():
    script = (ROOT / "launch" / "slurm.sbatch").read_text()
    requeued = {int(c) for c in re.findall(r'"\$rc" -eq (\d+)', script)}
    assert requeued == {c for c, r in ec.POLICY.items() if r.then == ec.REQUEUE} == {ec.PREEMPTED}


class _HungGroup(group.Group):
    """Two processes that stopped beating long ago and exit once killed."""

    processes, nodes, launch_id, pid = 2, [], "L1", 4242

    def __init__(self):
        self.signals: list[int] = []

    def wait(self, timeout=None) -> int:
        if signal.SIGKILL in self.signals:
            return -signal.SIGKILL
        raise subprocess.TimeoutExpired("group", timeout)

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)


def test_a_hang_reads_each_heartbeat_once_in_its_poll_and_once_after_the_exit(tmp_path, monkeypatch):
    cfg = load_config(None, [f"run.dir={tmp_path}", "supervisor.step_timeout_s=5", "supervisor.poll_s=0.01"])
    sup = supervisor.Supervisor(cfg, [])
    att = supervisor.Attempt(1, _HungGroup(), time.time() - 100)
    (tmp_path / rundir.HEARTBEAT).mkdir()
    for i in range(2):
        beat = {"phase": "step", "step": 9 + i, "time": time.time() - 60, "pid": 100 + i, "launch": "L1"}
        rundir.write_json(heartbeat.heartbeat_path(tmp_path, i), dict(beat, node=f"n{i}"))
        stacks = rundir.stack_file(tmp_path, 100 + i)  # as the workers dump them on SIGUSR1
        stacks.parent.mkdir(parents=True, exist_ok=True)
        stacks.write_text("Thread 0x1 (most recent call first):\n")
    reads = []
    real = heartbeat.read
    monkeypatch.setattr(heartbeat, "read", lambda path: reads.append(path.name) or real(path))
    assert sup._wait(att) == -signal.SIGKILL
    assert att.hang and att.proc.signals == [signal.SIGUSR1, signal.SIGKILL]
    assert sorted(reads) == ["worker-0.json", "worker-1.json"], reads  # one poll, one read of each
    ended = after_exit.ended(sup, att, -signal.SIGKILL)
    assert len(reads) == 4 and (ended.step, ended.hung) == (9, True)
    # the event's name as a literal on purpose: the file on disk says "hang_detected" (its format, not E's spelling)
    [hang] = [json.loads(x) for x in (tmp_path / rundir.EVENTS).read_text().splitlines() if "hang_detected" in x]
    assert (hang["step"], hang["phase"], hang["timeout_s"]) == (9, "step", 5), hang
