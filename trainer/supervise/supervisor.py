"""The supervisor: runs the worker process, detects crashes, hangs and preemption, restarts it from
the last checkpoint, and keeps the goodput ledger. It never imports jax, so it stays small, starts
fast and survives whatever the accelerator stack does to the worker.
"""

from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainer.config import Config, Phase
from trainer.observe import downtime, goodput, heartbeat, outcome, progress
from trainer.observe.events import EventLog, read_events
from trainer.store import env_vars, rundir
from trainer.store.event_names import (
    GAVE_UP,
    HANG_DETECTED,
    NODE_RETRIED,
    NODE_SUSPECT,
    PREEMPTED,
    REGROW,
    RESTART,
    RUN_COMPLETE,
    STRAGGLER_DRAINED,
    SUPERVISOR_START,
    WORKER_EXIT,
    WORKER_START,
)
from trainer.supervise import exit_codes, group, hang, launcher, replica_rewind, runbook, storage, straggler
from trainer.supervise.noise import is_library_noise


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
    pump: threading.Thread | None = None  # _pump: its output to our stderr and its log
    trains_since: float = 0.0  # when its heartbeat first said "step"


# How often a shrunk group checks whether it can regrow (launch.suspect_retry_minutes).
REGROW_CHECK_S = 10.0
# The next attempt's standby processes (launch.standby) start once the running one has trained this long: not
# for an attempt that dies in its first seconds (a crash loop), nor for a short run that ends before any need.
STANDBY_AFTER_S = 5.0


class Supervisor:
    def __init__(self, cfg: Config, argv: list[str]):
        self.cfg, self.sc = cfg, cfg.supervisor
        self.run_dir = Path(cfg.run.dir)
        self.worker_argv = [sys.executable, "-m", "trainer", "--worker", *argv]
        # Held back until a worker has accepted the config: a bad config never writes into an existing run dir.
        self.events = EventLog(self.run_dir / rundir.EVENTS, by="supervisor", hold=True)
        self.stop_signal: int | None = None  # the first SIGTERM or SIGINT the supervisor got
        self.forwarded = False  # ... passed on to the workers (once only)
        self.tally = exit_codes.Tally()  # the failure counters across attempts
        self.t0 = time.time()  # the session's start (run() sets it)
        self.accepted = False  # the worker got past config validation at least once
        self.launcher = launcher.Launcher(cfg.launch, run_dir=self.run_dir)
        self.overdue = hang.Overdue(cfg.alerts.overdue_fraction, self.events.write)
        self.regrow = False  # the running group was asked to save and stop so that it restarts at full size
        self.failure: dict | None = None  # the failure the next attempt recovers from (trainer.observe.downtime)
        self._regrow_checked = 0.0

    # --- worker lifecycle -------------------------------------------------------------------
    def _start(self, number: int) -> Attempt:
        log_dir = self.run_dir / rundir.LOGS
        env = dict(self._env(), **{env_vars.ATTEMPT: str(number)})
        if self.failure:
            env[env_vars.FAILURE] = downtime.for_next_attempt(self.failure, launched=time.time())
        proc = self.launcher.start(number, self.worker_argv, env)
        for node, reason in self.launcher.new_suspects:
            self.events.write(NODE_SUSPECT, step=_last_step(self.run_dir), node=node, reason=reason)
        for node in self.launcher.retried:
            self.events.write(NODE_RETRIED, step=_last_step(self.run_dir), node=node)
        att = Attempt(number, proc, time.time())
        if self.cfg.straggler.enabled and proc.processes > 1:
            att.stragglers = straggler.StragglerWatch(self.cfg.straggler, proc.processes)
        att.pump = threading.Thread(target=self._pump, args=(att, log_dir), daemon=True)
        att.pump.start()
        self.events.write(WORKER_START, pid=proc.pid, attempt=number, **self.launcher.describe())
        return att

    def _env(self) -> dict[str, str]:
        """The environment every attempt's workers share (a standby's too: trainer.supervise.standby)."""
        return dict(os.environ, **{env_vars.PYTHONUNBUFFERED: "1"}, **progress.env())

    def _pump(self, att: Attempt, log_dir: Path) -> None:
        """Copy worker output to our stderr (library noise: log only) and a per-attempt log; keep a tail."""
        log = None
        for raw in iter(att.proc.stdout.readline, b""):
            line = raw.decode(errors="replace")
            if not is_library_noise(line):
                sys.stderr.write(line)
            att.tail.append(line.rstrip("\n"))
            try:
                if log is None and self.accepted:
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

    def _timeout(self, phase: Phase) -> float:
        return phase.timeout(self.sc)

    def _snapshot(self, att: Attempt) -> heartbeat.Snapshot:
        return heartbeat.snapshot(self.run_dir, att.proc.processes, att.proc.launch_id)

    def _check_hang(self, att: Attempt, snap: heartbeat.Snapshot) -> bool:
        s = hang.silence(snap.beats, att.started, self._timeout)
        self.overdue.check(att.proc.pid, s)
        if s.silent_s <= s.timeout_s:
            return False
        culprit, node, why = hang.hung_on(s.beats, snap.beats, snap.pulses)
        self.events.open()
        self.events.write(
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
        hang.dump_stacks(self.run_dir, att.proc, snap.beats, self.events.write)
        att.hang = True
        att.proc.send_signal(signal.SIGKILL)
        return True

    def _check_frozen(self, att: Attempt, snap: heartbeat.Snapshot) -> bool:
        """A process whose pulse stopped while its peers' go on: killed now, not a step timeout later (hang.frozen)."""
        if att.proc.processes < 2:
            return False
        v = hang.frozen(snap.pulses, att.proc, self.events.write, step=snap.step)
        att.pulse_gap_s = max(att.pulse_gap_s, v.live_max_s)
        if v.frozen is None:
            return False
        att.failed, att.noticed, att.hang = v.failed, time.time(), True
        att.proc.send_signal(signal.SIGKILL)
        return True

    def _wait(self, att: Attempt) -> int:
        """Block until the worker exits; returns its code (negative = killed by that signal)."""
        while True:
            try:
                return att.proc.wait(timeout=self.sc.poll_s)
            except subprocess.TimeoutExpired:
                pass
            snap = self._snapshot(att)  # read once a poll: everyone who judges the heartbeats shares it
            if not self.accepted and snap.ready:
                self.accepted = True
                self.events.open()
            if self.accepted:
                self.launcher.start_guard(self.run_dir)
            if self.stop_signal is not None and not self.forwarded:
                # Once only: a second SIGTERM landing while a worker exits (its handler already gone) kills it.
                att.proc.send_signal(signal.SIGTERM)
                self.forwarded = True  # now wait for the save
            if not self.accepted:
                continue
            if snap.beats[0] and snap.beats[0].phase == Phase.STEP:  # it trains: recovered, if it recovers
                self.failure = None  # (its first step wrote the downtime event)
                att.trains_since = att.trains_since or time.time()
                if time.time() - att.trains_since > STANDBY_AFTER_S:  # not beside its own first steps
                    self.launcher.warm(self.worker_argv, self._env())
            if self._check_hang(att, snap) or self._check_frozen(att, snap):
                return att.proc.wait()
            self._watch_stragglers(att, snap)
            self._maybe_regrow(att)

    def _watch_stragglers(self, att: Attempt, snap: heartbeat.Snapshot) -> None:
        """The straggler verdicts from the heartbeats' timing: an event and an alert naming the process and its
        node; with straggler.action=drain and somewhere to run without that node, a save-and-stop (as on a
        preemption) and a restart that excludes it."""
        if att.stragglers is None or att.drain is not None:
            return
        for what, v in att.stragglers.observe(snap.beats, att.proc.launch_id):
            straggler.report(what, v, self.events.write, snap.step)
            if what != straggler.DECLARED or self.cfg.straggler.action != "drain":
                continue
            if not (n := self.launcher.drain_plan(v.node)):
                print("supervisor: straggler.action=drain, but nowhere to run without it: alert only", file=sys.stderr)
                continue
            print(f"supervisor: draining {v.node}: saving, restarting on {n} processes without it", file=sys.stderr)
            att.drain = v
            att.proc.blame_node(v.node, f"straggler: {straggler.describe(v)}")
            att.proc.send_signal(signal.SIGTERM)

    def _maybe_regrow(self, att: Attempt) -> None:
        """A shrunk group whose capacity is back saves and stops, then restarts at full size (every REGROW_CHECK_S)."""
        if self.regrow or not self.accepted or time.time() - self._regrow_checked < REGROW_CHECK_S:
            return
        self._regrow_checked = time.time()
        if self.launcher.can_regrow():
            self.regrow = True
            print("supervisor: nodes are back: saving to restart at full size", file=sys.stderr)
            att.proc.send_signal(signal.SIGTERM)

    # --- policy: trainer.supervise.exit_codes decides, the supervisor carries it out --------
    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.t0 = time.time()
        self.events.write(SUPERVISOR_START, pid=os.getpid())
        number, interim_ledger = 0, False
        while True:
            number += 1
            att = self._start(number)
            if interim_ledger:  # off the critical path: the new worker is already starting up
                self._write_ledger(_last_step(self.run_dir), final=False)
            code = self._wait(att)
            att.pump.join(timeout=1.0)  # its last lines (a refusal's error) out first; a pipe may be held open
            ended = self._ended(att, code)
            d = exit_codes.decide(ended, self.tally, self.sc)
            if d.do == exit_codes.REFUSED:
                return d.code
            self.events.open()
            self.accepted = True
            if att.stragglers is not None and (v := att.stragglers.end()):  # the seconds lost since its verdict
                straggler.report(straggler.CLEARED, v, self.events.write, ended.step)
            if (failed := self._remedy(d, att, ended.step)) is not None:
                return failed
            if d.do in (exit_codes.RESTART, exit_codes.RESUME):
                self._note_failure(att, d.reason)
            self.tally = d.tally
            if d.do == exit_codes.RESTART:
                self._restart(d, number, ended.step)
            elif d.do != exit_codes.RESUME:
                return self._stop(d, att, ended.step)
            interim_ledger = d.do == exit_codes.RESTART

    def _ended(self, att: Attempt, code: int) -> exit_codes.Exited:
        """The worker_exit event, and what happened, for exit_codes.decide()."""
        att.down = time.time()
        rundir.drop_empty_stacks(self.run_dir)  # every worker opens one; only a hang dump fills it
        att.last = self._snapshot(att)  # the worker is gone: its last beats
        how = att.proc.describe_exit()
        self.events.write(
            WORKER_EXIT,
            step=att.last.step,
            pid=att.proc.pid,
            attempt=att.number,
            **how,
            **({"signal": signal.Signals(-code).name} if code < 0 else {"exit_code": code}),
            **({"pulse_gap_s": round(att.pulse_gap_s, 2)} if att.proc.processes > 1 else {}),
        )
        return exit_codes.Exited(
            code,
            att.last.step,
            accepted=self.accepted,
            stopping=self._stopping(),
            draining=att.drain is not None,
            regrowing=self.regrow,
            hung=att.hang,
            blocked=bool(how.get("step_blocked")),
        )

    def _note_failure(self, att: Attempt, reason: str) -> None:
        """What the next attempt's downtime event starts from: when this group failed, when the supervisor knew,
        when the group was gone (the remedy that ran since, a runbook's say, is the relaunch's)."""
        noticed = att.noticed or att.proc.noticed_t or att.down
        ps = att.last.pulses  # as they stood once the group was gone
        failed = min(att.failed, noticed) if att.failed else downtime.failed_at(ps, att.proc.cause_t, noticed)
        since = self.failure["since"] if self.failure else failed  # an attempt that never stepped prolongs it
        self.failure = {"since": since, "failed": failed, "noticed": noticed, "down": att.down, "reason": reason}

    def _remedy(self, d: exit_codes.Decision, att: Attempt, step: int | None) -> int | None:
        """What runs between the attempts (exit_codes.Rule.remedy); the exit code if it failed."""
        if d.remedy == exit_codes.DRAIN:
            self.events.write(STRAGGLER_DRAINED, step=step, process=att.drain.process, node=att.drain.node)
        elif d.remedy == exit_codes.REGROW:
            self.regrow = False
            self.events.write(REGROW, step=step, processes=att.proc.processes, to=self.cfg.launch.processes)
        elif d.remedy == exit_codes.RUNBOOK:  # the loss-spike runbook: rewind + skip or soften, restart at once
            response = runbook.respond(self.run_dir, self.cfg, self.events.write)
            print(f"supervisor: {response.message}", file=sys.stderr)
            if response.action == runbook.GIVE_UP:
                self._write_ledger(step)
                return d.fails_as
        elif d.remedy == exit_codes.WAIT_FOR_ROOM:  # room for one more checkpoint, or a human
            wait = self.sc.storage_wait_minutes
            if not storage.wait_for_room(self.run_dir, wait, self.events.write, step=step, stop=self._stopping):
                return self._give_up(d.fails_as, step, "a checkpoint could not be written", att)
        elif d.remedy == exit_codes.REWIND_REPLICAS:  # silent data corruption: back to a checked state
            nodes = [hb.node if hb else "" for hb in att.last.beats]
            line, culprit = replica_rewind.rewind(self.run_dir, self.events.write, tag=att.number, nodes=nodes)
            print(f"supervisor: {line}", file=sys.stderr)
            if culprit:
                att.proc.blame_node(*culprit)
        return None

    def _restart(self, d: exit_codes.Decision, number: int, step: int | None) -> None:
        restarts = d.tally.restarts
        self.events.write(RESTART, step=step, reason=d.reason, attempt=number + 1, backoff_s=d.backoff_s)
        print(
            f"supervisor: worker failed ({d.reason}) at step {step}; restarting in {d.backoff_s:.1f}s "
            f"(restart {restarts}/{self.sc.max_restarts})",
            file=sys.stderr,
        )
        time.sleep(d.backoff_s)

    def _stop(self, d: exit_codes.Decision, att: Attempt, step: int | None) -> int:
        if d.do == exit_codes.FINISH:
            return self._complete(step)
        if d.do == exit_codes.GIVE_UP:
            return self._give_up(d.code, step, d.reason, att)
        if d.do == exit_codes.REQUEUE:
            self.events.write(PREEMPTED, step=step)
            print(
                f"supervisor: preempted at step {step}; checkpoint saved. Re-run the same command "
                f"(or requeue the job) to resume.",
                file=sys.stderr,
            )
            self._write_ledger(step)
        return d.code

    def _stopping(self) -> bool:
        return self.stop_signal is not None

    def _on_signal(self, signum, frame) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum

    def _give_up(self, code: int, step: int | None, reason: str, att: Attempt) -> int:
        what, restarts = exit_codes.NAMES[code], self.tally.restarts
        last = "\n".join([t for t in att.tail if not is_library_noise(t)][-10:])
        self.events.write(GAVE_UP, step=step, reason=what, last_error=reason, restarts=restarts)
        try:
            self._write_ledger(step)
        except OSError as e:  # a full disk (exit STORAGE) must not hide the message below behind a traceback
            print(f"supervisor: could not write the goodput ledger: {e}", file=sys.stderr)
        why = (
            f"at step {step} {reason} and no room for one more came in supervisor.storage_wait_minutes "
            f"({self.sc.storage_wait_minutes:g})"
            if code == exit_codes.STORAGE
            else f"the worker keeps failing at step {step} ({reason}) after {restarts} restarts"
        )
        print(f"supervisor: giving up ({what}): {why}. Last worker output:\n{last}", file=sys.stderr)
        return code

    def _complete(self, step: int | None) -> int:
        end = outcome.worker_end(self.run_dir)  # the run is complete, or stopped at train.stop_at_step
        self.events.write(end["event"] if end else RUN_COMPLETE, step=step, restarts=self.tally.restarts)
        self._write_ledger(step)
        if line := outcome.end_line(self.run_dir):
            print(line, file=sys.stderr)
        return exit_codes.OK

    def _write_ledger(self, step: int | None, *, final: bool = True) -> None:
        """Goodput to TensorBoard (at each restart too, so the dashboard shows it during the run); at the
        end of a session also into summary.json, followed by the run report."""
        restarts = self.tally.restarts
        ledger = goodput.ledger(read_events(self.run_dir / rundir.EVENTS), self.t0, time.time())
        goodput.to_tensorboard(self.run_dir / rundir.TENSORBOARD, ledger, restarts, step or 0)
        if not final:
            return
        path = self.run_dir / rundir.SUMMARY
        summary = rundir.read_json(path) or {}
        summary.update({k: ledger[k] for k in ("goodput", "recoveries_s", "downtime_s", "wall_s")}, restarts=restarts)
        rundir.write_json(path, summary)
        if self.cfg.log.report:
            from trainer.observe import report  # matplotlib: loaded only when a run ends

            report.write_safely(self.run_dir, self.events.write)


def _last_step(run_dir: Path) -> int | None:
    hb = heartbeat.read(heartbeat.heartbeat_path(run_dir, 0))
    return hb.step if hb else None


def main(cfg: Config, config_path: str | None, overrides: list[str]) -> int:
    run_dir = Path(cfg.run.dir)
    argv = (["--config", config_path] if config_path else []) + [a for o in overrides for a in ("--set", o)]
    sup = Supervisor(cfg, argv)  # first: it may still refuse the config (launch settings), before any write
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = rundir.lock(run_dir)
    if fd is None:
        print(
            f"error: run.dir {run_dir} is in use by another supervisor; wait for it or pick another run.dir",
            file=sys.stderr,
        )
        return exit_codes.LOCKED
    try:
        code = sup.run()
    finally:
        sup.launcher.close()
    if code == exit_codes.CONFIG and created and not sup.accepted:
        shutil.rmtree(run_dir, ignore_errors=True)  # leave no trace of a run that never started
    return code
