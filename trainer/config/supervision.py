"""The sections that keep a run alive and prove it does (supervisor, launch, alerts, straggler, runbook, and the
faults to inject), each with its rules; and the vocabularies a fault names: its kinds, the phases a worker
reports, the ways to corrupt a checkpoint. Each is declared here once, the lowest layer that names it."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Annotated

from trainer.yamltree import ConfigError, NonNegative, OneOf, Positive, Range, Section

# faults[].kind; trainer.faults.injector fires them
FAULT_KINDS = tuple(
    "crash hang crash_mid_save slow hog slow_save signal ecc nan spike bitflip startup node corrupt disk_full".split()
)


class Phase(enum.StrEnum):
    """The phases a worker's heartbeat names (trainer.observe.heartbeat), each with the SupervisorConfig field
    that bounds its silence. A StrEnum: each value is the very string the heartbeat file holds."""

    STEP = "step", "step_timeout_s"
    STARTUP = "startup", "startup_timeout_s"
    RESTORE = "restore", "restore_timeout_s"
    COMPILE = "compile", "startup_timeout_s"  # its compile is the end of the worker's start-up
    CHECKPOINT = "checkpoint", "checkpoint_timeout_s"
    EVAL = "eval", "eval_timeout_s"
    DONE = "done", "checkpoint_timeout_s"  # the final save made durable, then the exit

    def __new__(cls, value: str, timeout_field: str):
        member = str.__new__(cls, value)
        member._value_ = value
        member.timeout_field = timeout_field
        return member

    def timeout(self, sc: SupervisorConfig) -> float:
        """How long a worker may stay silent in this phase before it counts as hung."""
        return getattr(sc, self.timeout_field)


FAULT_PHASES = tuple(p for p in Phase if p is not Phase.DONE)  # hang and slow faults fire in any but done
CORRUPT_HOW = ("flip", "truncate", "torn")  # faults[].how for corrupt: trainer.faults.corrupt's functions


@dataclass
class Fault(Section):
    kind: str  # one of FAULT_KINDS (crash, hang, slow, node, ...): what fires; trainer.faults.injector says how
    step: NonNegative[int]  # startup: ignored (it fires while the worker starts, before any step)
    # slow: extra seconds per step; hog: its CPU burst per step (0: all the time); slow_save: extra seconds to
    # commit the durable save
    seconds: float = 0.0
    step_multiple: float = 0.0  # slow: sleep this many times the step time measured before it (not `seconds`)
    phase: str = Phase.STEP.value  # hang, slow: the phase they fire in, one of FAULT_PHASES (any Phase but done)
    count: int = 1  # slow, hog: how many steps; ecc: simulated ECC errors added per step from `step` on
    signal: str = "SIGKILL"  # signal: which one the worker sends itself
    scale: float = 1000.0  # spike: multiply the LR by this for the one update at `step`
    repeat: bool = False  # fire on every attempt (a deterministic bug), not just once
    process: int = 0  # the process it fires on (node: that process's whole node is lost; faults/lose_node.py)
    node: str = ""  # slow, hog: fire on whichever process runs on this node, on every attempt (a slow host)
    how: str = ""  # corrupt: flip | truncate | torn, what happens to the newest durable checkpoint before a crash

    def check(self, where: str) -> None:
        if self.kind not in FAULT_KINDS:
            raise ConfigError(f"{where}.kind must be one of {', '.join(FAULT_KINDS)}, got {self.kind!r}")
        if self.node and self.kind not in ("slow", "hog"):
            raise ConfigError(f"{where}.node is for slow and hog (a slow host), not {self.kind}: use process")
        if (self.kind == "corrupt") != bool(self.how) or (self.how and self.how not in CORRUPT_HOW):
            raise ConfigError(f"{where}.how is for corrupt only, one of {', '.join(CORRUPT_HOW)}, got {self.how!r}")
        if self.phase not in FAULT_PHASES or (self.phase != Phase.STEP and self.kind not in ("hang", "slow")):
            raise ConfigError(
                f"{where}.phase must be one of {', '.join(FAULT_PHASES)} (hang and slow only), "
                f"got {self.phase!r} for {self.kind}"
            )


@dataclass
class SupervisorConfig(Section):
    max_restarts: NonNegative[int] = 20
    backoff_s: float = 1.0  # delay before retrying a step that failed again; doubles up to backoff_max_s
    backoff_max_s: float = 60.0
    crash_loop_restarts: Positive[int] = 3  # this many failures with no step of progress = crash loop
    startup_timeout_s: float = 600.0  # heartbeat silence allowed while starting/compiling
    restore_timeout_s: float = 600.0
    step_timeout_s: Positive[float] = 120.0
    checkpoint_timeout_s: float = 600.0
    eval_timeout_s: Positive[float] = 600.0  # heartbeat silence allowed during a held-out eval (eval.every_steps)
    poll_s: Positive[float] = 0.5
    # a checkpoint that could not be written for want of space: wait this long for room for one more (an alert
    # meanwhile), then restart from the newest checkpoint; 0 = stop at once for a human (exit 81)
    storage_wait_minutes: NonNegative[float] = 30.0


@dataclass
class LaunchConfig(Section):
    processes: int = 1  # worker processes (one per host on GPUs); >1 forms a jax.distributed group
    mode: Annotated[str, OneOf("local", "slurm")] = "local"  # local: N subprocesses here | slurm: one srun step
    processes_per_node: int = 1  # slurm: tasks per node (several emulate hosts on one node)
    min_processes: int = 0  # slurm: with no spare node left, shrink down to this many (0 = never shrink)
    # slurm: retry a suspect SLURM says is up after this long; shrunk: regrow
    suspect_retry_minutes: NonNegative[float] = 0.0
    coordinator_port: int = 0  # 0 = local: a free port, slurm: from the job id (20000-32767); + the attempt
    init_timeout_s: int = 300  # how long processes wait for each other in jax.distributed.initialize
    exit_grace_s: float = 30.0  # after one process exits cleanly, how long the others get to follow
    # local: process i on its own CPUs, as if on its own host (test mode); 0 = any
    cpus_per_process: NonNegative[int] = 0
    # local: the next attempt's processes start ahead, imports done, and wait (trainer.supervise.standby): a
    # restart skips the imports, for an idle process's host memory per worker (docs/multihost.md has the cost)
    standby: bool = True

    def check(self, where: str) -> None:
        if self.processes < 1 or self.processes_per_node < 1 or self.init_timeout_s < 1:
            raise ConfigError(
                f"{where}.processes ({self.processes}), {where}.processes_per_node ({self.processes_per_node})"
                f" and {where}.init_timeout_s ({self.init_timeout_s}) must be >= 1"
            )
        if self.processes % self.processes_per_node:
            raise ConfigError(
                f"{where}.processes ({self.processes}) must be a multiple of {where}.processes_per_node"
                f" ({self.processes_per_node})"
            )
        if not 0 <= self.min_processes <= self.processes:
            raise ConfigError(
                f"{where}.min_processes must be in [0, {where}.processes={self.processes}], got {self.min_processes}"
            )
        if not (self.coordinator_port == 0 or 1024 <= self.coordinator_port <= 64000):
            raise ConfigError(
                f"{where}.coordinator_port must be 0 (pick one) or in [1024, 64000], got {self.coordinator_port}"
            )


@dataclass
class AlertsConfig(Section):
    grad_window: Positive[int] = 50  # grad-norm trend: compare the median of the last N steps with the N before
    grad_rise: Positive[float] = 2.0  # ... and alert when it grew by this factor
    throughput_window: Positive[int] = 50  # throughput: baseline = median tokens/s of the last N healthy steps
    # alert when recent tokens/s falls below this fraction of the baseline
    throughput_drop: Annotated[float, Range(0, 1, "()")] = 0.7
    throughput_steps: Positive[int] = 5  # ... as the median of this many consecutive steps (one slow step is noise)
    ecc_rise: Positive[int] = 1  # new ECC errors between two health samples that mean "rising": checkpoint now
    # supervisor alerts when heartbeat silence passes this part of the timeout
    overdue_fraction: Annotated[Positive[float], Range(0, 1, "()")] = 0.5

    def check(self, where: str) -> None:
        if self.grad_rise <= 1.0:
            raise ConfigError(f"{where}.grad_rise must be > 1 (a growth factor), got {self.grad_rise}")


@dataclass
class StragglerConfig(Section):
    """Which process slows the lockstep group (trainer.supervise.straggler): judged by the supervisor from the
    timing in every worker's heartbeat, with more than one process."""

    enabled: bool = True
    factor: float = 1.2  # verdict: one process's own time slows the group's step by this factor or more
    window_steps: Annotated[int, Range(1)] = 20  # clean steps per window (every process's), compared across processes
    windows: Annotated[int, Range(1)] = 2  # consecutive slow windows for a verdict (and calm ones to clear it)
    grace_steps: int = 5  # steps not counted after an attempt starts and after each save or eval
    mad_k: float = 3.0  # with 4+ processes: its excess must also pass mad_k x its peers' spread (MAD)
    # alert | drain (slurm: checkpoint, restart without its node; a spare takes its place)
    action: Annotated[str, OneOf("alert", "drain")] = "alert"

    def check(self, where: str) -> None:
        if self.factor <= 1.0:
            raise ConfigError(f"{where}.factor must be > 1 (a slowdown factor), got {self.factor}")
        if self.grace_steps < 0 or self.mad_k < 0:
            raise ConfigError(f"{where}.grace_steps ({self.grace_steps}) and {where}.mad_k ({self.mad_k}) must be >= 0")


@dataclass
class RunbookConfig(Section):
    enabled: bool = True  # detect loss spikes; the run then rewinds, skips, softens or gives up by itself
    window: Positive[int] = 128  # rolling window (steps) of loss and grad-norm statistics
    # no statistical detection before this step (the fast early drop); NaN/Inf always
    warmup_steps: NonNegative[int] = 100
    min_history: Positive[int] = 32  # steps in the window needed before judging (after a fresh start)
    loss_sigma: Positive[float] = 6.0  # spike: loss > window mean + loss_sigma * std ...
    # ... and > mean * (1 + loss_min_rise): a near-constant window is not a hair trigger
    loss_min_rise: NonNegative[float] = 0.1
    grad_sigma: Positive[float] = 6.0  # spike: grad norm > window mean + grad_sigma * std ...
    grad_min_rise: NonNegative[float] = 1.0  # ... and > mean * (1 + grad_min_rise)
    # ... for this many steps in a row (lone grad-norm blips that clipping absorbs are normal)
    grad_sustain: Positive[int] = 2
    onset_sigma: Positive[float] = 3.0  # steps right before a spike above this many sigma belong to it (where it began)
    # after a spike, read up to this many more batches with updates frozen to find its end
    probe_steps: NonNegative[int] = 16
    # a spike within this many steps of an earlier action is a recurrence: soften
    recur_distance: NonNegative[int] = 100
    lr_factor: Annotated[float, Range(0, 1, "(]")] = 0.5  # soften: multiply the peak LR by this
    clip_factor: Annotated[float, Range(0, 1, "(]")] = 0.5  # soften: multiply the gradient-clipping norm by this
    b2: float = 0.0  # soften: also set Adam b2 to this value (0 = leave b2 alone)
    max_actions: Positive[int] = 5  # rewinds (skip or soften) before giving up with exit code 79

    def check(self, where: str) -> None:
        if self.min_history > self.window:
            raise ConfigError(f"{where}.min_history ({self.min_history}) must be <= {where}.window ({self.window})")
        if self.onset_sigma > min(self.loss_sigma, self.grad_sigma):
            raise ConfigError(f"{where}.onset_sigma ({self.onset_sigma}) must be <= loss_sigma and grad_sigma")
        if not (self.b2 == 0.0 or 0.0 < self.b2 < 1.0):
            raise ConfigError(f"{where}.b2 must be 0 (unchanged) or in (0, 1), got {self.b2}")
