"""The watch over a running attempt, once a poll: one heartbeat snapshot, judged by each rule in turn (the
config accepted, a stop passed on, a hang, a frozen process, stragglers, a shrunk group that can regrow).
Never imports jax.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from trainer.config import Phase
from trainer.observe import heartbeat
from trainer.store.event_names import HANG_DETECTED
from trainer.supervise import attempt, hang, straggler
from trainer.supervise.attempt import Attempt
from trainer.supervise.session import Session

# How often a shrunk group checks whether it can regrow (launch.suspect_retry_minutes).
REGROW_CHECK_S = 10.0


def snapshot(run_dir: Path, att: Attempt) -> heartbeat.Snapshot:
    """The attempt's heartbeats and pulses as they stand now (read once a poll, and once after its exit)."""
    return heartbeat.snapshot(run_dir, att.proc.processes, att.proc.launch_id)


def poll(sup: Session, att: Attempt) -> bool:
    """One poll of a running attempt; True once a verdict killed it (a hang or a frozen process)."""
    snap = snapshot(sup.run_dir, att)  # read once a poll: everyone who judges the heartbeats shares it
    if not sup.accepted and snap.ready:
        sup.accepted = True
        sup.events.open()
    if sup.accepted:
        sup.launcher.start_guard(sup.run_dir)
    if sup.stop_signal is not None and not sup.forwarded:
        # Once only: a second SIGTERM landing while a worker exits (its handler already gone) kills it.
        att.proc.send_signal(signal.SIGTERM)
        sup.forwarded = True  # now wait for the save
    if not sup.accepted:
        return False
    if snap.beats[0] and snap.beats[0].phase == Phase.STEP:  # it trains: recovered, if it recovers
        sup.failure = None  # (its first step wrote the downtime event)
        attempt.warm_standby(sup, att)
    if check_hang(sup, att, snap) or check_frozen(sup, att, snap):
        return True
    watch_stragglers(sup, att, snap)
    maybe_regrow(sup, att)
    return False


def check_hang(sup: Session, att: Attempt, snap: heartbeat.Snapshot) -> bool:
    """A group silent past its phase's timeout: the event, the blame, its stacks dumped, then killed."""
    s = hang.silence(snap.beats, att.started, lambda phase: phase.timeout(sup.sc))
    sup.overdue.check(att.proc.pid, s)
    if s.silent_s <= s.timeout_s:
        return False
    culprit, node, why = hang.hung_on(s.beats, snap.beats, snap.pulses)
    sup.events.open()
    sup.events.write(
        HANG_DETECTED,
        step=s.step,
        pid=att.proc.pid,
        phase=s.phase,
        silent_s=s.silent_s,
        timeout_s=s.timeout_s,
        process=culprit,
        node=node,
        why=why,
    )
    att.failed, att.noticed = s.since, time.time()
    if node:
        att.proc.blame_node(node, why)
    hang.dump_stacks(sup.run_dir, att.proc, snap.beats, sup.events.write)
    att.hang = True
    att.proc.send_signal(signal.SIGKILL)
    return True


def check_frozen(sup: Session, att: Attempt, snap: heartbeat.Snapshot) -> bool:
    """A process whose pulse stopped while its peers' go on: killed now, not a step timeout later (hang.frozen)."""
    if att.proc.processes < 2:
        return False
    v = hang.frozen(snap.pulses, att.proc, sup.events.write, step=snap.step)
    att.pulse_gap_s = max(att.pulse_gap_s, v.live_max_s)
    if v.frozen is None:
        return False
    att.failed, att.noticed, att.hang = v.failed, time.time(), True
    att.proc.send_signal(signal.SIGKILL)
    return True


def watch_stragglers(sup: Session, att: Attempt, snap: heartbeat.Snapshot) -> None:
    """The straggler verdicts from the heartbeats' timing: an event and an alert naming the process and its
    node; with straggler.action=drain and somewhere to run without that node, a save-and-stop (as on a
    preemption) and a restart that excludes it."""
    if att.stragglers is None or att.drain is not None:
        return
    for what, v in att.stragglers.observe(snap.beats, att.proc.launch_id):
        straggler.report(what, v, sup.events.write, snap.step)
        if what != straggler.DECLARED or sup.cfg.straggler.action != "drain":
            continue
        if not (n := sup.launcher.drain_plan(v.node)):
            print("supervisor: straggler.action=drain, but nowhere to run without it: alert only", file=sys.stderr)
            continue
        print(f"supervisor: draining {v.node}: saving, restarting on {n} processes without it", file=sys.stderr)
        att.drain = v
        att.proc.blame_node(v.node, f"straggler: {straggler.describe(v)}")
        att.proc.send_signal(signal.SIGTERM)


def maybe_regrow(sup: Session, att: Attempt) -> None:
    """A shrunk group whose capacity is back saves and stops, then restarts at full size (every REGROW_CHECK_S)."""
    if sup.regrow or not sup.accepted or time.time() - sup.regrow_checked < REGROW_CHECK_S:
        return
    sup.regrow_checked = time.time()
    if sup.launcher.can_regrow():
        sup.regrow = True
        print("supervisor: nodes are back: saving to restart at full size", file=sys.stderr)
        att.proc.send_signal(signal.SIGTERM)
