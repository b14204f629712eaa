"""The supervisor: runs the worker process, detects crashes, hangs and preemption, restarts it from
the last checkpoint, and keeps the goodput ledger. It never imports jax, so it stays small, starts
fast and survives whatever the accelerator stack does to the worker.
"""

from __future__ import annotations

import collections
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainer.config import Config
from trainer.observe import env_vars, goodput, heartbeat, outcome, progress, rundir
from trainer.observe.alerts import ALERTS
from trainer.observe.event_names import (
    ALERT,
    ALERT_CLEARED,
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
from trainer.observe.events import EventLog, read_events
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


# How often a shrunk group checks whether it can regrow (launch.suspect_retry_minutes).
REGROW_CHECK_S = 10.0


class Supervisor:
    def __init__(self, cfg: Config, argv: list[str]):
        self.cfg, self.sc = cfg, cfg.supervisor
        self.run_dir = Path(cfg.run.dir)
        self.worker_argv = [sys.executable, "-m", "trainer", "--worker", *argv]
        # Held back until a worker has accepted the config: a bad config never writes into an existing run dir.
        self.events = EventLog(self.run_dir / rundir.EVENTS, by="supervisor", hold=True)
        self.stop_signal: int | None = None
        self.accepted = False  # the worker got past config validation at least once
        self.launcher = launcher.Launcher(cfg.launch, run_dir=self.run_dir)
        self.overdue: tuple | None = None  # (pid, heartbeat time) of the silence a step_overdue alert is about
        self.regrow = False  # the running group was asked to save and stop so that it restarts at full size
        self._regrow_checked = 0.0

    # --- worker lifecycle -------------------------------------------------------------------
    def _start(self, number: int) -> Attempt:
        log_dir = self.run_dir / rundir.LOGS
        env = dict(os.environ, **{env_vars.PYTHONUNBUFFERED: "1", env_vars.ATTEMPT: str(number)}, **progress.env())
        proc = self.launcher.start(number, self.worker_argv, env)
        for node, reason in self.launcher.new_suspects:
            self.events.write(NODE_SUSPECT, step=_last_step(self.run_dir), node=node, reason=reason)
        for node in self.launcher.retried:
            self.events.write(NODE_RETRIED, step=_last_step(self.run_dir), node=node)
        att = Attempt(number, proc, time.time())
        if self.cfg.straggler.enabled and proc.processes > 1:
            att.stragglers = straggler.StragglerWatch(self.cfg.straggler, proc.processes)
        threading.Thread(target=self._pump, args=(att, log_dir), daemon=True).start()
        self.events.write(WORKER_START, pid=proc.pid, attempt=number, **self.launcher.describe())
        return att

    def _pump(self, att: Attempt, log_dir: Path) -> None:
        """Copy worker output to our stderr (library noise only to the log) and a per-attempt log; keep a tail
        for error messages."""
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

    def _timeout(self, phase: str) -> float:
        return heartbeat.phase_timeout(self.sc, phase)

    def _heartbeats(self, att: Attempt) -> list[dict | None]:
        """Each process's heartbeat from this attempt (None until it writes one)."""
        hbs = [heartbeat.read(heartbeat.heartbeat_path(self.run_dir, i)) for i in range(att.proc.processes)]
        return [hb if hb and hb.get("launch") == att.proc.launch_id else None for hb in hbs]

    def _check_hang(self, att: Attempt, hbs: list[dict | None]) -> bool:
        # Processes move in lockstep: one waiting in a collective for a slower peer (still compiling, say)
        # is not hung. The group is hung once every process is overdue for its own phase.
        beats = [
            (hb["phase"], hb["time"], hb["step"], i) if hb else ("startup", att.started, None, i)
            for i, hb in enumerate(hbs)
        ]
        phase, since, step, process = min(beats, key=lambda b: (time.time() - b[1]) / self._timeout(b[0]))
        # Say where the group is stuck: its lowest step (hosts dispatch a step ahead of their devices, so the
        # peers of a hung process may have started the next one before waiting on it).
        step = min((b[2] for b in beats if b[2] is not None), default=step)
        silent = time.time() - since
        self._warn_overdue(att, phase, since, silent, step)
        if silent <= self._timeout(phase):
            return False
        culprit, node, why = hang.hung_on(self.run_dir, att.proc, beats, self._heartbeats(att))
        self.events.open()
        self.events.write(
            HANG_DETECTED,
            step=step,
            pid=att.proc.pid,
            phase=phase,
            silent_s=silent,
            timeout_s=self._timeout(phase),
            process=culprit,
            node=node,
            why=why,
        )
        if node:
            att.proc.blame_node(node, why)
        hang.dump_stacks(self.run_dir, att.proc, self._heartbeats(att), self.events.write)
        att.hang = True
        att.proc.send_signal(signal.SIGKILL)
        return True

    def _warn_overdue(self, att: Attempt, phase: str, since: float, silent: float, step) -> None:
        """ "No step completed for too long": an alert while there is still time to look, well before the
        hang timeout kills the worker; cleared as soon as the heartbeat moves again."""
        limit = self.cfg.alerts.overdue_fraction * self._timeout(phase)
        if silent > limit and self.overdue is None:
            self.overdue = (att.proc.pid, since)
            meaning, action = ALERTS["step_overdue"]
            self.events.write(
                ALERT,
                step=step,
                kind="step_overdue",
                phase=phase,
                silent_s=silent,
                detail=f"phase {phase}: no heartbeat for {silent:.0f}s (alert at {limit:.0f}s, "
                f"killed at {self._timeout(phase):.0f}s)",
                meaning=meaning,
                runbook=action,
            )
        elif self.overdue is not None and self.overdue != (att.proc.pid, since):
            self.overdue = None
            self.events.write(ALERT_CLEARED, step=step, kind="step_overdue", detail=f"heartbeat moved ({phase})")

    def _wait(self, att: Attempt) -> int:
        """Block until the worker exits; returns its code (negative = killed by that signal)."""
        while True:
            try:
                return att.proc.wait(timeout=self.sc.poll_s)
            except subprocess.TimeoutExpired:
                pass
            if not self.accepted and _ready(self.run_dir, att.proc.launch_id):
                self.accepted = True
                self.events.open()
            if self.accepted:
                self.launcher.start_guard(self.run_dir)
            if self.stop_signal not in (None, -1):
                # Once only: a second SIGTERM landing while a worker exits (its handler already gone) kills it.
                att.proc.send_signal(signal.SIGTERM)
                self.stop_signal = -1  # forwarded once; now wait for the save
            if not self.accepted:
                continue
            hbs = self._heartbeats(att)  # read once a poll: the hang check and the straggler watch share them
            if self._check_hang(att, hbs):
                return att.proc.wait()
            self._watch_stragglers(att, hbs)
            self._maybe_regrow(att)

    def _watch_stragglers(self, att: Attempt, hbs: list[dict | None]) -> None:
        """The straggler verdicts from the heartbeats' timing: an event and an alert naming the process and its
        node; with straggler.action=drain and somewhere to run without that node, a save-and-stop (as on a
        preemption) and a restart that excludes it."""
        if att.stragglers is None or att.drain is not None:
            return
        step = _last_step(self.run_dir)
        for what, v in att.stragglers.observe(hbs, att.proc.launch_id):
            straggler.report(what, v, self.events.write, step)
            if what != "straggler" or self.cfg.straggler.action != "drain":
                continue
            if not (n := self.launcher.drain_plan(v.node)):
                print("supervisor: straggler.action=drain, but nowhere to run without it: alert only", file=sys.stderr)
                continue
            print(f"supervisor: draining {v.node}: saving, restarting on {n} processes without it", file=sys.stderr)
            att.drain = v
            att.proc.blame_node(v.node, f"straggler: {straggler.describe(v)}")
            att.proc.send_signal(signal.SIGTERM)

    def _maybe_regrow(self, att: Attempt) -> None:
        """A shrunk group whose lost capacity is back is asked to save and stop (as on a preemption), then
        restarted at full size. Checked every REGROW_CHECK_S (sinfo is a call to slurmctld)."""
        if self.regrow or not self.accepted or time.time() - self._regrow_checked < REGROW_CHECK_S:
            return
        self._regrow_checked = time.time()
        if self.launcher.can_regrow():
            self.regrow = True
            print("supervisor: nodes are back: saving to restart at full size", file=sys.stderr)
            att.proc.send_signal(signal.SIGTERM)

    # --- policy -----------------------------------------------------------------------------
    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        t0 = time.time()
        self.events.write(SUPERVISOR_START, pid=os.getpid())
        same_step_failures, restarts, last_fail_step, blocked_streak = 0, 0, "unset", 0
        interim_ledger = False
        number = 0
        while True:
            number += 1
            att = self._start(number)
            if interim_ledger:  # off the critical path: the new worker is already starting up
                self._write_ledger(t0, restarts, final=False)
                interim_ledger = False
            code = self._wait(att)
            rundir.drop_empty_stacks(self.run_dir)  # every worker opens one; only a hang dump fills it
            step = _last_step(self.run_dir)
            self.events.write(
                WORKER_EXIT,
                step=step,
                pid=att.proc.pid,
                attempt=number,
                **att.proc.describe_exit(),
                **({"signal": signal.Signals(-code).name} if code < 0 else {"exit_code": code}),
            )
            if code == exit_codes.CONFIG and not self.accepted:
                return exit_codes.CONFIG
            self.events.open()
            self.accepted = True
            if att.stragglers is not None and (v := att.stragglers.end()):  # the seconds lost since its verdict
                straggler.report("cleared", v, self.events.write, step)
            if code == exit_codes.OK:
                return self._complete(t0, restarts)
            if code == exit_codes.PREEMPTED and att.drain is not None and self.stop_signal is None:
                self.events.write(STRAGGLER_DRAINED, step=step, process=att.drain.process, node=att.drain.node)
                continue
            if code == exit_codes.PREEMPTED and self.regrow and self.stop_signal is None:
                self.regrow = False
                self.events.write(REGROW, step=step, processes=att.proc.processes, to=self.cfg.launch.processes)
                continue
            if code == exit_codes.PREEMPTED or self.stop_signal is not None:
                self.events.write(PREEMPTED, step=step)
                print(
                    f"supervisor: preempted at step {step}; checkpoint saved. Re-run the same command "
                    f"(or requeue the job) to resume.",
                    file=sys.stderr,
                )
                self._write_ledger(t0, restarts)
                return exit_codes.PREEMPTED
            if code == exit_codes.CONFIG:
                return exit_codes.CONFIG
            if code == exit_codes.SPIKE:  # the loss-spike runbook: rewind + skip or soften, restart at once
                outcome = runbook.respond(self.run_dir, self.cfg, self.events.write)
                print(f"supervisor: {outcome.message}", file=sys.stderr)
                if outcome.action == runbook.GIVE_UP:
                    self._write_ledger(t0, restarts)
                    return exit_codes.RUNBOOK_GAVE_UP
                continue
            if code == exit_codes.STORAGE and not storage.wait_for_room(  # room for one more, or a human
                self.run_dir, self.sc.storage_wait_minutes, self.events.write, step=step, stop=self._stopping
            ):
                return self._give_up(code, step, "a checkpoint could not be written", att, t0, restarts)
            reason = "hang" if att.hang else f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            reason = "disk full" if code == exit_codes.STORAGE else reason
            if code == exit_codes.REPLICA_MISMATCH:  # silent data corruption: back to a checked state, then restart
                nodes = [(hb or {}).get("node", "") for hb in self._heartbeats(att)]
                line, culprit = replica_rewind.rewind(self.run_dir, self.events.write, tag=number, nodes=nodes)
                print(f"supervisor: {line}", file=sys.stderr)
                if culprit:
                    att.proc.blame_node(*culprit)
                reason = "replica mismatch"
            # A crash loop is the same step failing again and again; random faults land elsewhere. An attempt
            # whose srun step never started (its nodes still held) ran nothing: it backs off, bounded by the
            # restart budget, but is no crash.
            blocked = bool(att.proc.describe_exit().get("step_blocked"))
            if blocked:
                reason = "step could not start"
                blocked_streak += 1
            else:
                blocked_streak = 0
                same_step_failures = same_step_failures + 1 if step == last_fail_step else 1
                last_fail_step = step
            if same_step_failures >= self.sc.crash_loop_restarts:
                return self._give_up(exit_codes.CRASH_LOOP, step, reason, att, t0, restarts)
            if restarts >= self.sc.max_restarts:
                return self._give_up(exit_codes.RESTART_BUDGET, step, reason, att, t0, restarts)
            # A failure at a new step restarts at once: each second here is the whole cluster idle. Only a
            # step that fails again backs off (exponentially, bounded), e.g. for a flaky filesystem.
            tries = blocked_streak + 1 if blocked else same_step_failures
            delay = 0.0 if tries == 1 else min(self.sc.backoff_s * 2 ** (tries - 2), self.sc.backoff_max_s)
            restarts += 1
            self.events.write(RESTART, step=step, reason=reason, attempt=number + 1, backoff_s=delay)
            interim_ledger = True
            print(
                f"supervisor: worker failed ({reason}) at step {step}; restarting in {delay:.1f}s "
                f"(restart {restarts}/{self.sc.max_restarts})",
                file=sys.stderr,
            )
            time.sleep(delay)

    def _stopping(self) -> bool:
        return self.stop_signal is not None

    def _on_signal(self, signum, frame) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum

    def _give_up(self, code: int, step, reason: str, att: Attempt, t0: float, restarts: int) -> int:
        what = exit_codes.NAMES[code]
        last = "\n".join([t for t in att.tail if not is_library_noise(t)][-10:])
        self.events.write(GAVE_UP, step=step, reason=what, last_error=reason, restarts=restarts)
        try:
            self._write_ledger(t0, restarts)
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

    def _complete(self, t0: float, restarts: int) -> int:
        end = outcome.worker_end(self.run_dir)  # the run is complete, or stopped at train.stop_at_step
        self.events.write(end["event"] if end else RUN_COMPLETE, step=_last_step(self.run_dir), restarts=restarts)
        self._write_ledger(t0, restarts)
        if line := outcome.end_line(self.run_dir):
            print(line, file=sys.stderr)
        return exit_codes.OK

    def _write_ledger(self, t0: float, restarts: int, *, final: bool = True) -> None:
        """Goodput to TensorBoard (at each restart too, so the dashboard shows it during the run); at the
        end of a session also into summary.json, followed by the run report."""
        ledger = goodput.ledger(read_events(self.run_dir / rundir.EVENTS), t0, time.time())
        goodput.to_tensorboard(self.run_dir / rundir.TENSORBOARD, ledger, restarts, _last_step(self.run_dir) or 0)
        if not final:
            return
        path = self.run_dir / rundir.SUMMARY
        summary = rundir.read_json(path) or {}
        summary.update(
            goodput=ledger["goodput"], restarts=restarts, recoveries_s=ledger["recoveries_s"], wall_s=ledger["wall_s"]
        )
        rundir.write_json(path, summary)
        if self.cfg.log.report:
            from trainer.observe import report  # matplotlib: loaded only when a run ends

            report.write_safely(self.run_dir, self.events.write)


def _ready(run_dir: Path, launch_id: str) -> bool:
    hb = heartbeat.read(heartbeat.heartbeat_path(run_dir, 0))
    return bool(hb and hb.get("launch") == launch_id)  # the worker writes heartbeats only after validating


def _last_step(run_dir: Path) -> int | None:
    hb = heartbeat.read(heartbeat.heartbeat_path(run_dir, 0))
    return hb["step"] if hb else None


def _lock(run_dir: Path) -> int | None:
    """flock on the run dir itself: released by the kernel when the holder dies, so a stale lock
    from a dead supervisor is simply taken over."""
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def main(cfg: Config, config_path: str | None, overrides: list[str]) -> int:
    run_dir = Path(cfg.run.dir)
    argv = (["--config", config_path] if config_path else []) + [a for o in overrides for a in ("--set", o)]
    sup = Supervisor(cfg, argv)  # first: it may still refuse the config (launch settings), before any write
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = _lock(run_dir)
    if fd is None:
        print(
            f"error: run.dir {run_dir} is in use by another supervisor; wait for it or pick another run.dir",
            file=sys.stderr,
        )
        return exit_codes.LOCKED
    code = sup.run()
    if code == exit_codes.CONFIG and created and not sup.accepted:
        shutil.rmtree(run_dir, ignore_errors=True)  # leave no trace of a run that never started
    return code
