"""The names of events.jsonl's events, each spelled once, and the groups readers ask about (how a run ends,
how a session or an attempt starts, the spike runbook's actions). The strings are the file format: changing
one breaks every run dir already written. No imports.
"""

# --- written by the worker ---------------------------------------------------------------------------------
SESSION_START = "session_start"  # an unsupervised worker (`--worker`) starts a session
CONFIG_CHANGED = "config_changed"  # a resume with a changed (allowed) config key
DATA_READY = "data_ready"  # the corpus is loaded: its fingerprint and size
ELASTIC_MICROBATCHES = "elastic_microbatches"  # a shrunk process group keeps the global batch
STACK_CHANGED = "stack_changed"  # resumed on another software stack
HEALTH_SOURCE = "health_source"  # where device health is read from
INIT = "init"  # fresh params
INIT_FROM = "init_from"  # params taken from another run (train.init_from)
RESTORE = "restore"  # resumed from a checkpoint
COMPILED = "compiled"
WORKER_READY = "worker_ready"  # startup done: the first step is next
DOWNTIME = "downtime"  # a restarted attempt's first step: what the failure cost, part by part (observe.downtime)
STEP = "step"
EVAL = "eval"
HEALTH = "health"
ALERT = "alert"  # the supervisor's step_overdue too
ALERT_CLEARED = "alert_cleared"
CHECKPOINT_NOW = "checkpoint_now"  # a monitor asked for a checkpoint at once
CHECKPOINT_INTERVAL = "checkpoint_interval"  # checkpoint.every_minutes=auto chose an interval
CHECKPOINT_SAVED = "checkpoint_saved"
CHECKPOINT_FAILED = "checkpoint_failed"
CHECKPOINT_REJECTED = "checkpoint_rejected"  # failed verification or loading; moved aside
CHECKPOINT_RESEALED = "checkpoint_resealed"  # a staged step whose upload to the bucket was cut short, uploaded again
SPIKE_DETECTED = "spike_detected"
SPIKE_EXIT = "spike_exit"  # the worker exits for the spike runbook
REPLICA_MISMATCH = "replica_mismatch"  # replicas of a parameter diverged: silent data corruption
RUN_COMPLETE = "run_complete"
STOPPED = "stopped"  # at train.stop_at_step
PREEMPTED = "preempted"  # the worker's, and the supervisor's copy ("by": "supervisor")
REPORT_FAILED = "report_failed"  # the end-of-run report could not be written; the run is not failed by it

# --- written by the supervisor -----------------------------------------------------------------------------
SUPERVISOR_START = "supervisor_start"
WORKER_START = "worker_start"
WORKER_EXIT = "worker_exit"
HANG_DETECTED = "hang_detected"
STACKS_DUMPED = "stacks_dumped"
RESTART = "restart"
NODE_SUSPECT = "node_suspect"  # a SLURM node blamed for a failure (node, reason); later steps avoid it
NODE_RETRIED = "node_retried"  # a suspect node tried again (launch.suspect_retry_minutes passed, SLURM says it is up)
REGROW = "regrow"  # a shrunk group saved and stopped to restart at full size on nodes that came back
STRAGGLER = "straggler"  # one process slows the group (trainer.supervise.straggler): process, node, section
STRAGGLER_CLEARED = "straggler_cleared"  # it keeps pace again, or its attempt ended: the seconds lost since
STRAGGLER_DRAINED = "straggler_drained"  # straggler.action=drain: its group saved and stopped; restart without it
GAVE_UP = "gave_up"
REPLICA_REWIND = "replica_rewind"
SUPERVISOR_LOST = "supervisor_lost"  # a guard (trainer.supervise.guard) requeued a job whose supervisor went silent
# the spike runbook's: its actions skip and soften are recorded under the same names in runbook.json
REWIND = "rewind"
SKIP = "skip"
SOFTEN = "soften"
RUNBOOK_GAVE_UP = "runbook_gave_up"

# --- groups ------------------------------------------------------------------------------------------------
# A session is one invocation: a supervisor, or a worker run unsupervised.
SESSION_STARTS = (SUPERVISOR_START, SESSION_START)
ATTEMPT_STARTS = (INIT, RESTORE)  # the worker writes one of these once per attempt
# How a run ends, and the state `status` shows after it. A worker ends one on purpose with WORKER_FINISHED,
# its part of a session cleanly with WORKER_CLEAN_END (the supervisor's copies carry "by").
RUN_ENDED = {
    RUN_COMPLETE: "COMPLETE",
    STOPPED: "STOPPED",
    PREEMPTED: "PREEMPTED",
    GAVE_UP: "FAILED",
    SPIKE_EXIT: "SPIKE EXIT",
    RUNBOOK_GAVE_UP: "FAILED (the spike runbook gave up)",
}
WORKER_FINISHED = (RUN_COMPLETE, STOPPED)
WORKER_CLEAN_END = (*WORKER_FINISHED, PREEMPTED)
RUNBOOK_RETRIES = (SKIP, SOFTEN)  # the runbook's actions that rewind and train on (the third gives up)
RUNBOOK_EVENTS = (SPIKE_DETECTED, REWIND, *RUNBOOK_RETRIES, RUNBOOK_GAVE_UP)  # a spike and what the runbook did
