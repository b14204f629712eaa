"""One attempt's group as one `srun` step across the chosen nodes of a SLURM allocation: srun's reports read
for which node failed and why, the step torn down without waiting on a lost node. Never imports jax.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Mapping

from trainer.supervise import exit_codes
from trainer.supervise.exit_codes import CHOSEN, CONSEQUENCES
from trainer.supervise.group import Group, Merged, spawn
from trainer.supervise.nodes import NODE_FAILURE, TASK_ERROR, task_error_code

# srun waiting for resources it may never get, e.g. `srun: Job 12 step creation temporarily disabled, retrying
# (Requested nodes are busy)` while an earlier step still holds a lost node; or giving up on the step.
_STEP_BLOCKED = re.compile(r"step creation temporarily disabled|Requested nodes are busy|Unable to create step")
# The step exists after all: srun says so after a retry, or a task prints (`--label`: "0: ...").
_STEP_STARTED = re.compile(r"srun: Step created|\d+: ")
# After a survivor reports a lost peer (exit PEER_LOST), how long the other tasks' reports may take before the
# step is torn down: a task that really died is reported before its peers' PEER_LOST (they wait
# trainer.__main__.PEER_DEATH_GRACE_S first); a lost node's task is never reported at all.
PEER_REPORT_GRACE_S = 0.5
# Reports that may be consequences, not causes: exit_codes.CONSEQUENCES (a survivor's lost peer, and SIGABRT: jax's
# coordination client aborts when a peer vanishes). The other reports get PEER_REPORT_GRACE_S; any other kind is
# the cause.
# How long srun may wait for a step it cannot create before the attempt is ended and planned again.
STEP_START_GRACE_S = 15.0
_QUIET = {"timeout": 60, "capture_output": True}


class SrunGroup(Group):
    """One srun step across the chosen nodes. `--kill-on-bad-exit` makes SLURM end the whole step
    when one task dies; srun's task errors name the nodes and the causes. Every step is created with
    `--overlap`: a step that held a lost node stays in SLURM until the node is marked DOWN (SlurmdTimeout
    later; minutes on real clusters), and a non-overlapping step on its surviving nodes would wait for it
    ("Requested nodes are busy"). The supervisor has already killed that step's tasks."""

    def __init__(
        self, cmd: list[str], env: Mapping[str, str], *, processes: int, nodes: list[str], launch_id: str, job_id: str
    ):
        self.processes, self.nodes, self.launch_id, self._job = processes, nodes, launch_id, job_id
        self.errors: list[tuple[str, int]] = []  # (node, code) of each failed task report, in srun's order
        self.node_failures: list[str] = []  # nodes SLURM reported failed while the step ran
        self.blocked: str = ""  # srun's line saying the step cannot be created (yet)
        self._blocked_t = 0.0
        self._peer_lost_t = 0.0
        self._proc = spawn(cmd, env)
        self.pid = self._proc.pid
        self.stdout = Merged([self._proc.stdout], label=False, on_line=self._watch)
        self._step = ""
        self._killing = False
        self._blamed: list[tuple[str, str]] = []

    def blame_node(self, node: str, why: str) -> None:
        self._blamed = [(node, why)]

    @property
    def first_error(self) -> tuple[str, int] | None:
        return self.errors[0] if self.errors else None

    def _watch(self, line: str) -> None:
        line = line.rstrip()
        if m := NODE_FAILURE.search(line):
            self.node_failures.append(m.group(1))
            self._seen(cause=True)
        elif (m := TASK_ERROR.search(line)) and (code := task_error_code(m.group(2))) is not None:
            self.errors.append((m.group(1), code))
            if not self._killing:
                self._seen(cause=code not in CONSEQUENCES)
            if code in CONSEQUENCES and not self._peer_lost_t:
                self._peer_lost_t = time.monotonic()
        elif _STEP_BLOCKED.search(line) and not self.blocked:
            self.blocked, self._blocked_t = line, time.monotonic()
        elif self._blocked_t and _STEP_STARTED.match(line):
            self._blocked_t = 0.0  # srun got its step after all: the tasks run

    def _should_end(self) -> bool:
        now = time.monotonic()
        return bool(
            self._cause()
            or (self._peer_lost_t and now - self._peer_lost_t > PEER_REPORT_GRACE_S)
            or (self._blocked_t and now - self._blocked_t > STEP_START_GRACE_S)
        )

    def poll(self) -> int | None:
        code = self._proc.poll()
        if code is None:
            if not self._killing and self._should_end():
                # SLURM would SIGTERM the survivors and SIGKILL them only after KillWait (30 s by default);
                # they cannot finish a step without their peer, so do not wait. A lost node's task is not
                # reported at all, and srun would wait for it until SLURM marks the node DOWN.
                self._killing = True
                self.send_signal(signal.SIGKILL)
            return None
        # srun reports the worst task code, which is often a peer SLURM killed; the first error is the cause.
        ranked = sorted(self.errors, key=lambda e: (e[1] == exit_codes.PEER_LOST, e[1] in CONSEQUENCES))
        self.returncode = ranked[0][1] if ranked else code
        return self.returncode

    def _step_id(self) -> str:
        if not self._step:
            out = subprocess.run(
                ["squeue", "-h", "-s", "-j", self._job, "-o", "%i %j"], capture_output=True, text=True, timeout=30
            ).stdout
            self._step = next((ln.split()[0] for ln in out.splitlines() if ln.split()[1:] == [self.launch_id]), "")
        return self._step

    def send_signal(self, sig: int) -> None:
        """Signals go to the step's tasks on every node: srun itself would turn SIGTERM into a kill. scancel runs
        beside the supervisor, never in its way: it returns only once every node of the step answered, and a
        lost node answers never (scancel waits SLURM's MessageTimeout for it, which would all be downtime if the
        supervisor waited). The live nodes get the signal at once either way."""
        step = self._step_id() if self._proc.poll() is None else ""
        if sig == signal.SIGKILL or not step:  # no step yet (srun still waiting for nodes): stop srun
            try:
                os.killpg(self._proc.pid, sig)
            except ProcessLookupError:
                pass
        if step:
            cmd = ["scancel", f"--signal={signal.Signals(sig).name[3:]}", step]
            threading.Thread(target=subprocess.run, args=(cmd,), kwargs=_QUIET, daemon=True).start()

    def describe_exit(self) -> dict:
        out: dict = {"first_task_error": list(self.first_error)} if self.first_error else {}
        if len(self.errors) > 1:
            out["task_errors"] = [list(e) for e in self.errors]
        if self.node_failures:
            out["node_failures"] = self.node_failures
        if self.blocked:
            out["step_blocked"] = self.blocked
        return out

    def failed_node(self) -> str | None:
        """A node SLURM reported failed; else the node whose task died first, unless it left on purpose
        (preempted, spike, ...) or as a consequence of a lost peer (PEER_LOST, SIGABRT); else, when every node
        reported and all were consequences, the first abort."""
        if cause := self._cause():
            return cause
        if {n for n, _ in self.errors} >= set(self.nodes):
            return next((n for n, c in self.errors if c == -signal.SIGABRT), None)
        return None

    def _cause(self) -> str | None:
        """A node failure, or the first task that died neither on purpose nor as a consequence. A task that
        left on purpose first (a STORAGE exit leaves alone, at once) makes `--kill-on-bad-exit` kill its
        peers: those kills are its consequence, not their nodes' failure."""
        if self.node_failures:
            return self.node_failures[0]
        chosen = False
        for n, c in self.errors:
            chosen |= c in CHOSEN
            if c not in (*CHOSEN, *CONSEQUENCES) and not (chosen and c == -signal.SIGKILL):
                return n
        return None

    def blame(self) -> list[tuple[str, str]]:
        """(node, why) for each node this attempt's failure points at: the node whose task died first; or,
        when the only reports are survivors' reactions to lost peers, the step's nodes whose tasks were never
        reported (a lost node's tasks vanish with it, and srun hears nothing from them)."""
        if self._blamed:  # the supervisor knows better than srun's reports of the kill that followed
            return self._blamed
        if self.node_failures:
            return [(n, "SLURM reported a node failure during the step") for n in dict.fromkeys(self.node_failures)]
        if node := self.failed_node():
            code = next(c for n, c in self.errors if n == node)
            what = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            return [(node, f"its task failed first ({what})")]
        if any(c in CONSEQUENCES for _, c in self.errors):
            reported = {n for n, _ in self.errors}
            return [
                (n, "its task vanished without a report while its peers lost their connection to it")
                for n in self.nodes
                if n not in reported
            ]
        return []
