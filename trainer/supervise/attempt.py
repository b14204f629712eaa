"""One attempt: its group of workers started with the environment every attempt shares (and the failure it
recovers from), its output copied to our stderr and its log, and the next attempt's standby processes started
once this one trains. Never imports jax.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainer.observe import downtime, heartbeat, progress
from trainer.store import env_vars, rundir
from trainer.store.event_names import NODE_RETRIED, NODE_SUSPECT, WORKER_START
from trainer.supervise import group, straggler
from trainer.supervise.noise import is_library_noise
from trainer.supervise.session import Session

# The next attempt's standby processes (launch.standby) start once the running one has trained this long: not
# for an attempt that dies in its first seconds (a crash loop), nor for a short run that ends before any need.
STANDBY_AFTER_S = 5.0


@dataclass
class Attempt:
    number: int
    proc: group.Group  # all worker processes of this attempt, behaving like one Popen
    started: float
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=30))
    hang: bool = False
    stragglers: straggler.StragglerWatch | None = None  # with more than one process
    drain: straggler.Verdict | None = None  # straggler.action=drain asked the group to save and stop
    last: heartbeat.Snapshot | None = None  # its heartbeats once it has exited
    pulse_gap_s: float = 0.0  # the largest pulse silence of a live process seen (the frozen rule's margin)
    failed: float = 0.0  # a hang or frozen verdict's estimate of when the group stopped, and the verdict's time
    noticed: float = 0.0
    down: float = 0.0  # when its last process was gone
    pump: threading.Thread | None = None  # pump(): its output to our stderr and its log
    trains_since: float = 0.0  # when its heartbeat first said "step"


def start(sup: Session, number: int) -> Attempt:
    """Launch attempt `number`, with its events (suspect and retried nodes, worker_start), and pump its output."""
    log_dir = sup.run_dir / rundir.LOGS
    env = dict(worker_env(), **{env_vars.ATTEMPT: str(number)})
    if sup.failure:
        env[env_vars.FAILURE] = downtime.for_next_attempt(sup.failure, launched=time.time())
    proc = sup.launcher.start(number, sup.worker_argv, env)
    for node, reason in sup.launcher.new_suspects:
        sup.events.write(NODE_SUSPECT, step=last_step(sup.run_dir), node=node, reason=reason)
    for node in sup.launcher.retried:
        sup.events.write(NODE_RETRIED, step=last_step(sup.run_dir), node=node)
    att = Attempt(number, proc, time.time())
    if sup.cfg.straggler.enabled and proc.processes > 1:
        att.stragglers = straggler.StragglerWatch(sup.cfg.straggler, proc.processes)
    att.pump = threading.Thread(target=pump, args=(att, log_dir, sup), daemon=True)
    att.pump.start()
    sup.events.write(WORKER_START, pid=proc.pid, attempt=number, **sup.launcher.describe())
    return att


def worker_env() -> dict[str, str]:
    """The environment every attempt's workers share (a standby's too: trainer.supervise.standby)."""
    return dict(os.environ, **{env_vars.PYTHONUNBUFFERED: "1"}, **progress.env())


def pump(att: Attempt, log_dir: Path, sup: Session) -> None:
    """Copy worker output to our stderr (library noise: log only) and a per-attempt log; keep a tail. The log
    opens only once a worker accepted the config (sup.accepted): a refused config writes nothing."""
    log = None
    for raw in iter(att.proc.stdout.readline, b""):
        line = raw.decode(errors="replace")
        if not is_library_noise(line):
            sys.stderr.write(line)
        att.tail.append(line.rstrip("\n"))
        try:
            if log is None and sup.accepted:
                log_dir.mkdir(parents=True, exist_ok=True)
                log = open(log_dir / f"worker-{att.number}.log", "a", buffering=1)  # a full disk fails a write
                log.writelines(t + "\n" for t in att.tail)
            elif log:
                log.write(line)
        except OSError as e:  # disk full: keep draining the pipe (a full pipe would stall the worker)
            print(f"supervisor: worker log not written ({e}); output continues here only", file=sys.stderr)
            log = False
    if log:
        log.close()


def warm_standby(sup: Session, att: Attempt) -> None:
    """At each poll where the attempt trains: once it has trained STANDBY_AFTER_S, the next attempt's standby
    processes start (the launcher starts them once, and only with launch.standby)."""
    att.trains_since = att.trains_since or time.time()
    if time.time() - att.trains_since > STANDBY_AFTER_S:  # not beside its own first steps
        sup.launcher.warm(sup.worker_argv, worker_env())


def last_step(run_dir: Path) -> int | None:
    """The step process 0's heartbeat names (None before it wrote one)."""
    hb = heartbeat.read(heartbeat.heartbeat_path(run_dir, 0))
    return hb.step if hb else None
