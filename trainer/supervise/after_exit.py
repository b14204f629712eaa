"""What the supervisor does once an attempt's workers are gone: the worker_exit event and the facts that
exit_codes.decide() reads, then the decision carried out: the remedy between attempts, a restart, or the end
of the session (complete, requeue, give up) with its goodput ledger. Never imports jax.
"""

from __future__ import annotations

import signal
import sys
import time

from trainer.observe import downtime, goodput, outcome
from trainer.observe.events import read_events
from trainer.store import rundir, summary
from trainer.store.event_names import (
    GAVE_UP,
    PREEMPTED,
    REGROW,
    RESTART,
    RUN_COMPLETE,
    STRAGGLER_DRAINED,
    WORKER_EXIT,
)
from trainer.supervise import exit_codes, replica_rewind, runbook, storage
from trainer.supervise.attempt import Attempt
from trainer.supervise.noise import is_library_noise
from trainer.supervise.session import Session
from trainer.supervise.watch import snapshot


def ended(sup: Session, att: Attempt, code: int) -> exit_codes.Exited:
    """The worker_exit event, and what happened, for exit_codes.decide()."""
    att.down = time.time()
    rundir.drop_empty_stacks(sup.run_dir)  # every worker opens one; only a hang dump fills it
    att.last = snapshot(sup.run_dir, att)  # the worker is gone: its last beats
    how = att.proc.describe_exit()
    sup.events.write(
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
        accepted=sup.accepted,
        stopping=sup.stopping(),
        draining=att.drain is not None,
        regrowing=sup.regrow,
        hung=att.hang,
        blocked=bool(how.get("step_blocked")),
    )


def note_failure(sup: Session, att: Attempt, reason: str) -> None:
    """What the next attempt's downtime event starts from: when this group failed, when the supervisor knew,
    when the group was gone (the remedy that ran since, a runbook's say, is the relaunch's)."""
    noticed = att.noticed or att.proc.noticed_t or att.down
    ps = att.last.pulses  # as they stood once the group was gone
    failed = min(att.failed, noticed) if att.failed else downtime.failed_at(ps, att.proc.cause_t, noticed)
    since = sup.failure["since"] if sup.failure else failed  # an attempt that never stepped prolongs it
    sup.failure = {"since": since, "failed": failed, "noticed": noticed, "down": att.down, "reason": reason}


def remedy(sup: Session, d: exit_codes.Decision, att: Attempt, step: int | None) -> int | None:
    """What runs between the attempts (exit_codes.Rule.remedy); the exit code if it failed."""
    if d.remedy == exit_codes.DRAIN:
        sup.events.write(STRAGGLER_DRAINED, step=step, process=att.drain.process, node=att.drain.node)
    elif d.remedy == exit_codes.REGROW:
        sup.regrow = False
        sup.events.write(REGROW, step=step, processes=att.proc.processes, to=sup.cfg.launch.processes)
    elif d.remedy == exit_codes.RUNBOOK:  # the loss-spike runbook: rewind + skip or soften, restart at once
        response = runbook.respond(sup.run_dir, sup.cfg, sup.events.write)
        print(f"supervisor: {response.message}", file=sys.stderr)
        if response.action == runbook.GIVE_UP:
            write_ledger(sup, step)
            return d.fails_as
    elif d.remedy == exit_codes.WAIT_FOR_ROOM:  # room for one more checkpoint, or a human
        wait = sup.sc.storage_wait_minutes
        if not storage.wait_for_room(sup.run_dir, wait, sup.events.write, step=step, stop=sup.stopping):
            return give_up(sup, d.fails_as, step, "a checkpoint could not be written", att)
    elif d.remedy == exit_codes.REWIND_REPLICAS:  # silent data corruption: back to a checked state
        nodes = [hb.node if hb else "" for hb in att.last.beats]
        line, culprit = replica_rewind.rewind(sup.run_dir, sup.events.write, tag=att.number, nodes=nodes)
        print(f"supervisor: {line}", file=sys.stderr)
        if culprit:
            att.proc.blame_node(*culprit)
    return None


def restart(sup: Session, d: exit_codes.Decision, number: int, step: int | None) -> None:
    """The restart event and line, then the backoff before attempt `number` + 1."""
    restarts = d.tally.restarts
    sup.events.write(RESTART, step=step, reason=d.reason, attempt=number + 1, backoff_s=d.backoff_s)
    print(
        f"supervisor: worker failed ({d.reason}) at step {step}; restarting in {d.backoff_s:.1f}s "
        f"(restart {restarts}/{sup.sc.max_restarts})",
        file=sys.stderr,
    )
    time.sleep(d.backoff_s)


def stop(sup: Session, d: exit_codes.Decision, att: Attempt, step: int | None) -> int:
    """The session ends (complete, give up or requeue); the supervisor's exit code."""
    if d.do == exit_codes.FINISH:
        return complete(sup, step)
    if d.do == exit_codes.GIVE_UP:
        return give_up(sup, d.code, step, d.reason, att)
    if d.do == exit_codes.REQUEUE:
        sup.events.write(PREEMPTED, step=step)
        print(
            f"supervisor: preempted at step {step}; checkpoint saved. Re-run the same command "
            f"(or requeue the job) to resume.",
            file=sys.stderr,
        )
        write_ledger(sup, step)
    return d.code


def give_up(sup: Session, code: int, step: int | None, reason: str, att: Attempt) -> int:
    """The gave_up event, the ledger, and a line naming why with the worker's last output."""
    what, restarts = exit_codes.NAMES[code], sup.tally.restarts
    last = "\n".join([t for t in att.tail if not is_library_noise(t)][-10:])
    sup.events.write(GAVE_UP, step=step, reason=what, last_error=reason, restarts=restarts)
    try:
        write_ledger(sup, step)
    except OSError as e:  # a full disk (exit STORAGE) must not hide the message below behind a traceback
        print(f"supervisor: could not write the goodput ledger: {e}", file=sys.stderr)
    why = (
        f"at step {step} {reason} and no room for one more came in supervisor.storage_wait_minutes "
        f"({sup.sc.storage_wait_minutes:g})"
        if code == exit_codes.STORAGE
        else f"the worker keeps failing at step {step} ({reason}) after {restarts} restarts"
    )
    print(f"supervisor: giving up ({what}): {why}. Last worker output:\n{last}", file=sys.stderr)
    return code


def complete(sup: Session, step: int | None) -> int:
    """The run is complete, or stopped at train.stop_at_step: its event, the ledger and the outcome's line."""
    end = outcome.worker_end(sup.run_dir)  # the run is complete, or stopped at train.stop_at_step
    sup.events.write(end["event"] if end else RUN_COMPLETE, step=step, restarts=sup.tally.restarts)
    write_ledger(sup, step)
    if line := outcome.end_line(sup.run_dir):
        print(line, file=sys.stderr)
    return exit_codes.OK


def write_ledger(sup: Session, step: int | None, *, final: bool = True) -> None:
    """Goodput to TensorBoard (at each restart too, so the dashboard shows it during the run); at the
    end of a session also into summary.json, followed by the run report."""
    restarts = sup.tally.restarts
    ledger = goodput.ledger(read_events(sup.run_dir / rundir.EVENTS), sup.t0, time.time())
    goodput.to_tensorboard(sup.run_dir / rundir.TENSORBOARD, ledger, restarts, step or 0)
    if not final:
        return
    figures = {k: ledger[k] for k in ("goodput", "recoveries_s", "downtime_s", "wall_s")}
    summary.update(sup.run_dir, **figures, restarts=restarts)
    if sup.cfg.log.report:
        from trainer.observe import report  # matplotlib: loaded only when a run ends

        report.write_safely(sup.run_dir, sup.events.write)
