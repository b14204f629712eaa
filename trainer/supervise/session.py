"""What the supervisor knows across the attempts of one session: the config, the event log, the launcher, the
failure counters, and the flags that the poll (watch.py), the exit handling (after_exit.py) and the signal
handler (supervisor.py) share. Never imports jax.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from trainer.config import Config
from trainer.observe.events import EventLog
from trainer.store import rundir
from trainer.supervise import exit_codes, hang, launcher


class Session:
    def __init__(self, cfg: Config, argv: list[str]):
        self.cfg, self.sc = cfg, cfg.supervisor
        self.run_dir = Path(cfg.run.dir)
        self.worker_argv = [sys.executable, "-m", "trainer", "--worker", *argv]
        # Held back until a worker has accepted the config: a bad config never writes into an existing run dir.
        self.events = EventLog(self.run_dir / rundir.EVENTS, by="supervisor", hold=True)
        self.stop_signal: int | None = None  # the first SIGTERM or SIGINT the supervisor got
        self.forwarded = False  # ... passed on to the workers (once only)
        self.tally = exit_codes.Tally()  # the failure counters across attempts
        self.t0 = time.time()  # the session's start (Supervisor.run sets it)
        self.accepted = False  # the worker got past config validation at least once
        self.launcher = launcher.Launcher(cfg.launch, run_dir=self.run_dir)
        self.overdue = hang.Overdue(cfg.alerts.overdue_fraction, self.events.write)
        self.regrow = False  # the running group was asked to save and stop so that it restarts at full size
        self.failure: dict | None = None  # the failure the next attempt recovers from (trainer.observe.downtime)
        self.regrow_checked = 0.0  # when the watch last asked the launcher whether the group can regrow

    def stopping(self) -> bool:
        """A SIGTERM or SIGINT came: the workers save and stop, and the session ends without another attempt."""
        return self.stop_signal is not None
