"""The drill's fault kinds, as a table: one Kind record each (what it is, what the trainer's `faults` entry
gets, where the schedule may land it, the timeout that finds a hang), and which of them a configuration can be
drilled with here. trainer.drill.plan draws its schedule by reading this table.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config import CORRUPT_HOW, Config, Phase


@dataclass(frozen=True)
class Kind:
    """One fault kind: what it is, what the trainer's `faults` entry gets, and where the schedule may land it."""

    what: str  # in words
    fault: str = ""  # the trainer's faults[].kind it becomes, when not its own name
    restarts: bool = False  # a failure the run restarts after: failures land 2 steps apart at least
    fires: str = "step"  # where it fires from the step drawn: a FIRES key
    phase: str = ""  # the trainer phase its hang waits in (faults[].phase)
    hang_timeout: str = ""  # the supervisor's timeout it waits out before it is found (a SupervisorConfig field)
    needs: str = ""  # what must come before it: a NEEDS key
    rewinds: bool = False  # a runbook rewind: spaced wider than runbook.recur_distance from any other rewind
    at_most: str = ""  # a budget shared by the kinds that name it: a BUDGETS key
    by_drill: bool = False  # the drill sends it (no `faults` entry), PREEMPT_LEAD_S before the end at least
    fixed: tuple[tuple[str, float], ...] = ()  # fields of its `faults` entry that never change
    draws: str = ""  # a field of its `faults` entry drawn for each fault: "how" (CORRUPTIONS) or "process"


FIRES = {
    "step": "at the step drawn",
    "after_save": "the step after the next periodic save, while that save is in flight",
    "in_save": "in the first periodic save at or after the step drawn (planned there, so failures stay apart)",
    "restart": "in the restart after the last failure before it, armed at the checkpoint that restart reads",
    "phase": "the first time its phase is entered at or after the step drawn",
}
NEEDS = {
    "failure": "an earlier failure whose restart no other hang fires in (one more is a crash loop)",
    "warmup": "the runbook's warm-up and history behind it (runbook.warmup_steps + runbook.min_history)",
    "pace": "the pace before it: the throughput alert's and the straggler watch's windows since the last failure",
}
BUDGETS = {
    "once": "one: its alert stays open, so a second rise shows nothing",
    "spares": "one per spare node: SLURM marks a lost node down for good",
    "runbook": "runbook.max_actions: one rewind more and the runbook stops the run for a human",
}
CORRUPTIONS = CORRUPT_HOW  # what a corrupt fault may do: the config's faults[].how (trainer.config owns it)
SLOW_STEPS, SLOW_MULTIPLE = 20, 3.0
# One row per kind. "preempt" is the drill's own: a SIGTERM to the supervisor, as a scheduler sends it; every
# other kind is a `faults` entry the workers fire themselves.
KINDS = {
    "crash": Kind("the worker process dies (SIGKILL-like exit) at a step", restarts=True),
    "crash_after_save": Kind(
        "the worker dies the step after a periodic save, while the save is in flight",
        fault="crash",
        restarts=True,
        fires="after_save",
    ),
    "hang": Kind(
        "the step hangs (alive, no progress), as in a stuck collective",
        restarts=True,
        hang_timeout=Phase.STEP.timeout_field,
    ),
    "hang_startup": Kind(
        "the start-up of the restart after a failure hangs (e.g. a peer that never joins)",
        fault="hang",
        fires="restart",
        phase="startup",
        hang_timeout=Phase.STARTUP.timeout_field,
        needs="failure",
    ),
    "hang_restore": Kind(
        "the restore of the restart after a failure hangs",
        fault="hang",
        fires="restart",
        phase="restore",
        hang_timeout=Phase.RESTORE.timeout_field,
        needs="failure",
    ),
    "hang_compile": Kind(
        "the compile of the restart after a failure hangs",
        fault="hang",
        fires="restart",
        phase="compile",
        hang_timeout=Phase.COMPILE.timeout_field,
        needs="failure",
    ),
    "hang_checkpoint": Kind(
        "a save hangs (storage that stops answering)",
        fault="hang",
        restarts=True,
        fires="phase",
        phase="checkpoint",
        hang_timeout=Phase.CHECKPOINT.timeout_field,
    ),
    "hang_eval": Kind(
        "a held-out eval hangs",
        fault="hang",
        restarts=True,
        fires="phase",
        phase="eval",
        hang_timeout=Phase.EVAL.timeout_field,
    ),
    "crash_mid_save": Kind("the worker dies while a save is being written", restarts=True, fires="in_save"),
    "corrupt": Kind(
        "the newest durable checkpoint gets flipped bytes, a truncated file or torn metadata; then a crash",
        restarts=True,
        draws="how",
    ),
    "preempt": Kind(
        "SIGTERM to the supervisor, as a scheduler preempting the job; the drill requeues it",
        restarts=True,
        by_drill=True,
    ),
    "spike": Kind(
        "one update with a 1000x LR: the loss spike runbook rewinds and skips",
        restarts=True,
        needs="warmup",
        rewinds=True,
        at_most="runbook",
    ),
    "nan": Kind(
        "one update turns the params NaN: the runbook rewinds and skips",
        restarts=True,
        rewinds=True,
        at_most="runbook",
    ),
    "ecc": Kind("a host's ECC error count rises: checkpoint now", at_most="once"),
    "slow": Kind(
        f"one process's host work slows {SLOW_MULTIPLE:g}x for {SLOW_STEPS} steps",
        needs="pace",
        fixed=(("count", SLOW_STEPS), ("step_multiple", SLOW_MULTIPLE)),
    ),
    "bitflip": Kind(
        "one replica's params get a flipped bit (silent data corruption): caught and rewound",
        restarts=True,
    ),
    "disk_full": Kind(
        "a durable save finds the disk full (ENOSPC, injected): the supervisor waits for room, restarts",
        restarts=True,
    ),
    "node": Kind(  # never a process of the first node's: the drill and the supervisor live there
        "a whole node lost (its processes, slurmd and node-local tier at once); a spare takes its place",
        restarts=True,
        at_most="spares",
        draws="process",
    ),
}
# views of the table, for the drill's checks
RESTARTS = frozenset(k for k, row in KINDS.items() if row.restarts)
AFTER_RESTART = frozenset(k for k, row in KINDS.items() if row.fires == "restart")
HANG_TIMEOUTS = {k: row.hang_timeout for k, row in KINDS.items() if row.hang_timeout}


def available(cfg: Config, spares: int | None = None) -> tuple[list[str], dict[str, str]]:
    """The kinds this configuration can be drilled with here, and why each other one is left out. `spares`:
    the allocation's nodes beyond the configuration's (None: not inside a SLURM allocation)."""
    out: dict[str, str] = {}
    if spares is None or cfg.launch.mode != "slurm":
        out["node"] = "not inside a SLURM allocation (sbatch launch/slurm.sbatch drill ...): no node to lose"
    elif cfg.launch.processes <= cfg.launch.processes_per_node:
        out["node"] = "one node trains: losing it loses the drill too; drill with launch.processes over 2 nodes"
    elif spares < 1:
        out["node"] = "no spare node in the allocation: a lost node could not be replaced; allocate one more"
    if not cfg.integrity.replica_check_steps:
        out["bitflip"] = "integrity.replica_check_steps is 0: nothing would look for a flipped bit"
    if not cfg.runbook.enabled:
        out["spike"] = out["nan"] = "runbook.enabled is false: a spike would train on"
    if not cfg.log.health:
        out["ecc"] = "log.health is false: no health monitor reads ECC counts"
    if not cfg.checkpoint.every_steps:
        out["crash_after_save"] = "checkpoint.every_steps is 0: no periodic save to crash after"
    if not cfg.eval.every_steps:
        out["hang_eval"] = "eval.every_steps is 0: no eval to hang"
    if not (cfg.checkpoint.every_steps or cfg.checkpoint.every_minutes):
        out["disk_full"] = "no periodic durable save: none to find the disk full"
    elif not cfg.supervisor.storage_wait_minutes:
        out["disk_full"] = "supervisor.storage_wait_minutes is 0: a full disk stops the run for a human"
    return [k for k in KINDS if k not in out], out
