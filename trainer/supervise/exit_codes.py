"""Process exit codes shared by the worker, the supervisor and the SLURM job script."""

OK = 0
CONFIG = 2  # bad input: nothing was started, the run dir is untouched
LOCKED = 73  # another supervisor holds the run dir
PREEMPTED = 75  # SIGTERM: checkpoint saved and durable; requeue the job
CRASH_LOOP = 76  # the same step keeps failing: a human must look
RESTART_BUDGET = 77  # too many restarts in total
SPIKE = 78  # worker -> supervisor: a loss spike was detected; run the runbook
RUNBOOK_GAVE_UP = 79  # the spike runbook spent its budget of actions
REPLICA_MISMATCH = 80  # worker -> supervisor: data-parallel replicas diverged (silent data corruption); rewind
STORAGE = 81  # a checkpoint could not be written (disk full, write error): earlier ones are intact
PEER_LOST = 82  # a collective failed because a peer went away (its node died): this process's node is not to blame

NAMES = {
    OK: "ok",
    CONFIG: "config error",
    LOCKED: "run dir locked",
    PREEMPTED: "preempted",
    CRASH_LOOP: "crash loop",
    RESTART_BUDGET: "restart budget spent",
    SPIKE: "loss spike",
    RUNBOOK_GAVE_UP: "runbook gave up",
    REPLICA_MISMATCH: "replica mismatch",
    STORAGE: "checkpoint storage failed",
    PEER_LOST: "lost a peer",
}

# What a collective raises when a peer process or its node went away (gloo over TCP, NCCL, the coordination
# service): the process that prints it is a survivor, not the cause.
PEER_LOSS_MARKS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
)


def is_peer_loss(text: str) -> bool:
    return any(m in text for m in PEER_LOSS_MARKS)
