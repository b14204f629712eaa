"""Process exit codes shared by the worker, the supervisor and the SLURM job script, and the supervisor's exit
policy: one record per code (POLICY: its name, what the supervisor does next, whose node is to blame, whether
the peers follow, what runs before a restart) read by one pure function, decide(). The supervisor carries the
decision out (trainer.supervise.supervisor); the launchers read the blame and peers columns. Never imports jax.
"""

from __future__ import annotations

import dataclasses
import signal
from dataclasses import dataclass

from trainer.config import SupervisorConfig

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

# What the supervisor does once an attempt has ended (Rule.then, Decision.do).
FINISH = "finish"  # the run is complete (or stopped at train.stop_at_step): exit OK
STOP = "stop"  # exit with the worker's code: nothing a retry would fix
REQUEUE = "requeue"  # the checkpoint is saved: exit PREEMPTED, and the job script requeues the job
RESUME = "resume"  # start the next attempt at once, not counted as a failure
RESTART = "restart"  # a failure: the next attempt from the last checkpoint, counted (crash loop, budget, backoff)
REFUSED = "refused"  # (Decision only) no worker ever accepted the config: exit CONFIG, the run dir untouched
GIVE_UP = "give_up"  # (Decision only) a failure too many: exit CRASH_LOOP or RESTART_BUDGET

# What runs between the attempts (Rule.remedy, Decision.remedy).
RUNBOOK = "runbook"  # the loss-spike runbook rewinds, skips or softens (trainer.supervise.runbook)
WAIT_FOR_ROOM = "wait_for_room"  # until one more checkpoint fits (trainer.supervise.storage)
REWIND_REPLICAS = "rewind_replicas"  # back to the last step whose replicas agreed (trainer.supervise.replica_rewind)
DRAIN = "drain"  # the supervisor asked for the save and stop: the next attempt runs without the straggler's node
REGROW = "regrow"  # ... the next attempt runs at full size again

# Whose node is suspect when a process of the group exits with the code (Rule.blame).
NOBODY = "nobody"  # the worker chose the exit: its node is not suspect, nor those srun kills after it
PEER = "peer"  # a survivor's reaction to a lost peer (a collective failed, jax aborted): the peer's node
ITSELF = "itself"  # its own node: a crash, a signal


@dataclass(frozen=True)
class Rule:
    """What one exit code means to the supervisor."""

    name: str  # in messages and the gave_up event
    then: str  # FINISH | STOP | REQUEUE | RESUME | RESTART, when no stop was asked for (a stop requeues)
    blame: str  # NOBODY | PEER | ITSELF
    peers_follow: bool = False  # every process exits so at the same step: the launcher waits for the others
    remedy: str = ""  # what runs before the next attempt (RUNBOOK | WAIT_FOR_ROOM | REWIND_REPLICAS)
    fails_as: int | None = None  # the supervisor's exit code when the remedy fails (runbook spent, no room)
    reason: str = ""  # the restart's reason ("": the exit code, the signal, or "hang")


# One record per exit code. The codes only the supervisor exits with (LOCKED, CRASH_LOOP, RESTART_BUDGET,
# RUNBOOK_GAVE_UP) are crashes when a worker exits with them. A CONFIG exit is no peers_follow: it may be one
# process's start-up failure while the others wait for it; nor is STORAGE: the process whose save failed
# leaves at once.
POLICY: dict[int, Rule] = {
    OK: Rule("ok", FINISH, NOBODY, peers_follow=True),
    CONFIG: Rule("config error", STOP, NOBODY),
    LOCKED: Rule("run dir locked", RESTART, ITSELF),
    PREEMPTED: Rule("preempted", REQUEUE, NOBODY, peers_follow=True),
    CRASH_LOOP: Rule("crash loop", RESTART, ITSELF),
    RESTART_BUDGET: Rule("restart budget spent", RESTART, ITSELF),
    SPIKE: Rule("loss spike", RESUME, NOBODY, peers_follow=True, remedy=RUNBOOK, fails_as=RUNBOOK_GAVE_UP),
    RUNBOOK_GAVE_UP: Rule("runbook gave up", RESTART, ITSELF),
    REPLICA_MISMATCH: Rule(
        "replica mismatch", RESTART, NOBODY, peers_follow=True, remedy=REWIND_REPLICAS, reason="replica mismatch"
    ),
    STORAGE: Rule(
        "checkpoint storage failed", RESTART, NOBODY, remedy=WAIT_FOR_ROOM, fails_as=STORAGE, reason="disk full"
    ),
    PEER_LOST: Rule("lost a peer", RESTART, PEER),
    -signal.SIGABRT: Rule("aborted", RESTART, PEER),  # jax's coordination client aborts when a peer vanishes
}
CRASH = Rule("crash", RESTART, ITSELF)  # any other exit code or signal


def rule_for(code: int) -> Rule:
    return POLICY.get(code, CRASH)


NAMES = {code: r.name for code, r in POLICY.items() if code >= 0}
# The columns the launchers read, as sets of codes.
CHOSEN = frozenset(code for code, r in POLICY.items() if r.blame == NOBODY)  # left on purpose: not a node's fault
CONSEQUENCES = frozenset(code for code, r in POLICY.items() if r.blame == PEER)  # of a lost peer, not a cause
PEERS_FOLLOW = frozenset(code for code, r in POLICY.items() if r.peers_follow)


@dataclass(frozen=True)
class Exited:
    """What happened to one attempt, as the supervisor saw it."""

    code: int  # the group's exit code; negative: killed by that signal
    step: int | None  # process 0's latest heartbeat step (None before its first)
    accepted: bool = True  # a worker got past config validation, in this attempt or an earlier one
    stopping: bool = False  # the supervisor was told to stop (SIGTERM, SIGINT)
    draining: bool = False  # the supervisor asked the group to save and stop to leave a straggler's node out
    regrowing: bool = False  # ... to restart at full size
    hung: bool = False  # the supervisor killed the group for a hang
    blocked: bool = False  # the srun step never started (its nodes still held): it ran nothing


@dataclass(frozen=True)
class Tally:
    """The failure counters carried from one attempt to the next."""

    restarts: int = 0  # counted restarts so far (supervisor.max_restarts)
    same_step: int = 0  # failures in a row at fail_step (supervisor.crash_loop_restarts)
    fail_step: int | None = None  # the step the latest failure happened at (None: before the first step)
    blocked: int = 0  # attempts in a row whose srun step never started


@dataclass(frozen=True)
class Decision:
    do: str  # FINISH | STOP | REQUEUE | RESUME | RESTART | REFUSED | GIVE_UP
    tally: Tally  # the counters after this exit
    code: int | None = None  # the supervisor's exit code, for all but RESUME and RESTART
    remedy: str = ""  # what runs first (RUNBOOK, WAIT_FOR_ROOM, REWIND_REPLICAS, DRAIN, REGROW)
    fails_as: int | None = None  # the exit code when the remedy fails
    reason: str = ""  # RESTART, GIVE_UP: what failed, for the event and the message
    backoff_s: float = 0.0  # RESTART: how long to wait before the next attempt


def decide(e: Exited, tally: Tally, sc: SupervisorConfig) -> Decision:
    """What to do after an attempt ended: its code's rule, unless the supervisor itself asked for the exit
    (a drain, a regrow) or was told to stop (then any exit but a finished run requeues)."""
    rule = rule_for(e.code)
    if rule.then == STOP and not e.accepted:
        return Decision(REFUSED, tally, code=e.code)
    if rule.then == FINISH:
        return Decision(FINISH, tally, code=OK)
    if rule.then == REQUEUE and not e.stopping and (e.draining or e.regrowing):
        return Decision(RESUME, tally, remedy=DRAIN if e.draining else REGROW)
    if rule.then == REQUEUE or e.stopping:
        return Decision(REQUEUE, tally, code=PREEMPTED)
    if rule.then == STOP:
        return Decision(STOP, tally, code=e.code)
    if rule.then == RESUME:
        return Decision(RESUME, tally, remedy=rule.remedy, fails_as=rule.fails_as)
    return _restart(e, rule, tally, sc)


def _restart(e: Exited, rule: Rule, tally: Tally, sc: SupervisorConfig) -> Decision:
    """A crash loop is the same step failing again and again; random faults land elsewhere. An attempt whose
    srun step never started ran nothing: it backs off, bounded by the restart budget, but is no crash. A
    failure at a new step restarts at once: each second here is the whole cluster idle. Only a step that fails
    again backs off (exponentially, bounded), e.g. for a flaky filesystem."""
    if e.blocked:
        reason = "step could not start"
        tally = dataclasses.replace(tally, blocked=tally.blocked + 1)
        tries = tally.blocked + 1
    else:
        how = f"signal {signal.Signals(-e.code).name}" if e.code < 0 else f"exit code {e.code}"
        reason = rule.reason or ("hang" if e.hung else how)
        same = tally.same_step + 1 if e.step == tally.fail_step else 1
        tally = dataclasses.replace(tally, blocked=0, same_step=same, fail_step=e.step)
        tries = same
    then = dict(remedy=rule.remedy, fails_as=rule.fails_as, reason=reason)
    if tally.same_step >= sc.crash_loop_restarts:
        return Decision(GIVE_UP, tally, code=CRASH_LOOP, **then)
    if tally.restarts >= sc.max_restarts:
        return Decision(GIVE_UP, tally, code=RESTART_BUDGET, **then)
    delay = 0.0 if tries == 1 else min(sc.backoff_s * 2 ** (tries - 2), sc.backoff_max_s)
    return Decision(RESTART, dataclasses.replace(tally, restarts=tally.restarts + 1), backoff_s=delay, **then)


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
