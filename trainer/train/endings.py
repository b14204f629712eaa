"""How an attempt ends: each way out of the loop writes its event and returns its exit code
(trainer.supervise.exit_codes), which the supervisor acts on."""

from __future__ import annotations

import os
import sys
import time

from trainer.config import Phase
from trainer.observe.alerts import Do
from trainer.observe.events import iter_events, newest_record
from trainer.store import rundir, summary
from trainer.store.ckpt_files import DURABLE
from trainer.store.event_names import (
    CHECKPOINT_FAILED,
    PREEMPTED,
    REPLICA_MISMATCH,
    RUN_COMPLETE,
    SPIKE_EXIT,
    STEP,
    STOPPED,
)
from trainer.supervise import exit_codes
from trainer.train.flags import Flags
from trainer.train.state import params_sha256
from trainer.train.worker import Worker


def end(w: Worker, flags: Flags, st, step: int, loss: float) -> int:
    w.heartbeat.beat(Phase.CHECKPOINT, step)
    w.ckpt.close()  # durable (and sealed) before we report anything as saved
    w.ckpt.drop_failed_local()
    if w.ckpt.failure():
        return storage_exit(w, step)
    if step < w.cfg.train.steps:  # ended early: a SIGTERM's requeue, or train.stop_at_step (a SIGTERM in the
        # last step lands here with the run done: it finishes, nothing to requeue)
        w.events.write(PREEMPTED if flags.stop else STOPPED, step=step)
        return exit_codes.PREEMPTED if flags.stop else exit_codes.OK
    finish(w, st, step, loss)
    return exit_codes.OK


def finish(w: Worker, st, step: int, loss: float | None) -> None:
    if loss is None:  # restored the final checkpoint (killed before this ran): the loss was logged back then
        loss = (newest_record(w.run_dir / rundir.EVENTS, STEP, step) or {}).get("loss")
    digest = params_sha256(st["params"])
    if w.primary:  # a fresh summary.json: the supervisor's ledger (if any) adds to it and replaces wall_s
        first = next(iter_events(w.run_dir / rundir.EVENTS))["time"]
        summary.update(
            w.run_dir,
            keep=(),
            final_step=step,
            final_loss=loss,
            params_sha256=digest,
            n_params=w.n_params,
            data_fingerprint=w.corpus.fingerprint,
            wall_s=time.time() - first,
        )
    w.events.write(RUN_COMPLETE, step=step, final_loss=loss, params_sha256=digest)
    w.heartbeat.beat(Phase.DONE, step)


def spike_exit(w: Worker, flags: Flags) -> int:
    """Leave without saving: the state after a spike is what the runbook rewinds away from."""
    spike = flags.spike or {}
    w.events.write(SPIKE_EXIT, step=spike.get("step"), **{k: v for k, v in spike.items() if k not in (Do.KEY, "step")})
    w.ckpt.close()  # let saves of earlier, good steps finish
    w.events.close()
    return exit_codes.SPIKE


def replica_exit(w: Worker, step: int, last_good: int, bad: dict) -> int:
    """Replicas of the params diverged: leave without saving; the supervisor rewinds to a checkpoint saved
    at or before `last_good` (every save was preceded by a check that passed) and restarts."""
    w.events.write(REPLICA_MISMATCH, step=step, last_good=last_good, **bad)
    odd = [d["device"] for d in bad["devices"] if d["odd"]]
    print(
        f"worker: replicas of {bad['param']} differ at step {step} (devices {odd} of "
        f"{[d['device'] for d in bad['devices']]}); last agreement at step {last_good}",
        file=sys.stderr,
    )
    w.ckpt.close()  # saves of earlier, checked states finish
    w.events.close()
    return exit_codes.REPLICA_MISMATCH


def storage_exit(w: Worker, step: int) -> int:
    """A checkpoint could not be written: say why and stop (a restart would only fill the disk again). No
    waiting on the failed save: a peer's background writer may wait in a barrier for it until a timeout."""
    w.ckpt.drop_failed_local()  # its event first, as a failed local save is said at every step
    msg = w.ckpt.failure() or "a checkpoint could not be written"
    w.events.write(CHECKPOINT_FAILED, step=step, tier=DURABLE, message=msg)
    print(f"worker: {msg}", file=sys.stderr, flush=True)
    w.events.close()
    w.scalars.close()
    os._exit(exit_codes.STORAGE)
