"""The supervisor: runs the worker process, detects crashes, hangs and preemption, restarts it from
the last checkpoint, and keeps the goodput ledger. It never imports jax, so it stays small, starts
fast and survives whatever the accelerator stack does to the worker.

The loop over attempts is here (Supervisor.run), with the signal handler and main(); starting an attempt is
attempt.py's, each poll's verdicts watch.py's, and what follows an exit after_exit.py's, all sharing the
session's state (session.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from trainer.config import Config
from trainer.store import rundir
from trainer.store.event_names import SUPERVISOR_START
from trainer.supervise import after_exit, attempt, exit_codes, straggler, watch
from trainer.supervise.attempt import Attempt
from trainer.supervise.session import Session


class Supervisor(Session):
    """A session's state (Session) and what drives it: the loop over attempts and the signal handler."""

    # --- policy: trainer.supervise.exit_codes decides, the supervisor carries it out --------
    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.t0 = time.time()
        self.events.write(SUPERVISOR_START, pid=os.getpid())
        number, interim_ledger = 0, False
        while True:
            number += 1
            att = attempt.start(self, number)
            if interim_ledger:  # off the critical path: the new worker is already starting up
                after_exit.write_ledger(self, attempt.last_step(self.run_dir), final=False)
            code = self._wait(att)
            att.pump.join(timeout=1.0)  # its last lines (a refusal's error) out first; a pipe may be held open
            ended = after_exit.ended(self, att, code)
            d = exit_codes.decide(ended, self.tally, self.sc)
            if d.do == exit_codes.REFUSED:
                return d.code
            self.events.open()
            self.accepted = True
            if att.stragglers is not None and (v := att.stragglers.end()):  # the seconds lost since its verdict
                straggler.report(straggler.CLEARED, v, self.events.write, ended.step)
            if (failed := after_exit.remedy(self, d, att, ended.step)) is not None:
                return failed
            if d.do in (exit_codes.RESTART, exit_codes.RESUME):
                after_exit.note_failure(self, att, d.reason)
            self.tally = d.tally
            if d.do == exit_codes.RESTART:
                after_exit.restart(self, d, number, ended.step)
            elif d.do != exit_codes.RESUME:
                return after_exit.stop(self, d, att, ended.step)
            interim_ledger = d.do == exit_codes.RESTART

    def _wait(self, att: Attempt) -> int:
        """Block until the worker exits; returns its code (negative = killed by that signal)."""
        while True:
            try:
                return att.proc.wait(timeout=self.sc.poll_s)
            except subprocess.TimeoutExpired:
                pass
            if watch.poll(self, att):  # a hang or frozen verdict killed it
                return att.proc.wait()

    def _on_signal(self, signum, frame) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum


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
