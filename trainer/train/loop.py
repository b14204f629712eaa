"""The worker loop: restore-or-init, compile, then the cadence of every step (heartbeat, data, step, log,
save, stop). Exit codes are in trainer.supervise.exit_codes.

The loop dispatches step n before reading step n-1's metrics, so the host never waits on the device
except one step behind.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import faulthandler
import os
import signal
import sys
import time
from typing import Any

import absl.logging
import jax

from trainer import xla_env
from trainer.ckpt import checkpoint, weights
from trainer.ckpt.save_policy import Requests, Save, SavePolicy
from trainer.config import Config, Phase, to_dict
from trainer.model.model import attention_impl
from trainer.observe import outcome
from trainer.observe.audit import AuditLog
from trainer.parallel import agree
from trainer.parallel import mesh as mesh_lib
from trainer.store import env_vars, rundir, summary
from trainer.store.ckpt_files import DURABLE, committed_steps, durable_dir
from trainer.store.event_names import (
    CHECKPOINT_INTERVAL,
    CHECKPOINT_SAVED,
    COMPILED,
    EVAL,
    INIT,
    INIT_FROM,
    RESTORE,
    WORKER_READY,
)
from trainer.supervise import exit_codes
from trainer.train import data, endings, evaluate, optim, replicas
from trainer.train.flags import Flags, Shared
from trainer.train.step import lower_train_step
from trainer.train.step_log import StepLog
from trainer.train.worker import Worker, setup, versions

absl.logging.set_verbosity(absl.logging.ERROR)  # Orbax's info/warnings would drown the progress line


@dataclasses.dataclass
class _Start:
    """What start-up hands the loop: the state (restored or fresh) at step `step`, the batches from there on,
    the compiled train step and eval, and how long start-up took."""

    state: Any
    step: int
    feed: data.Feed
    step_fn: Any
    ev: evaluate.Evaluator | None
    seconds: float


def run(cfg: Config) -> int:
    t_start = time.time()
    w = setup(cfg)
    flags = Flags(lr_scale_now=w.hyperparams["lr_scale"])
    _install_signals(w, flags)
    _enter(w, Phase.STARTUP, _newest_durable(w))  # a startup-phase fault at step S fires in a restart from S or later
    code = _train(w, flags, _start_up(w, t_start))
    w.heartbeat.ending()
    w.events.close()
    w.scalars.close()
    if env_vars.ATTEMPT not in os.environ:  # unsupervised: no one else will tidy up, report or say the end
        rundir.drop_empty_stacks(w.run_dir, [os.getpid()])
        if w.primary and cfg.log.report:
            from trainer.observe import report

            report.write_safely(w.run_dir)
        if w.primary and code == exit_codes.OK and (line := outcome.end_line(w.run_dir)):
            print(line, file=sys.stderr)
    return code


def in_training(e: BaseException) -> bool:
    """Whether `e` came out of the training loop, past start-up: there an exception is more likely a peer's death
    seen through a collective than this process's own fault (trainer.__main__ waits for the peer's to show)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code is not _train.__code__:
        tb = tb.tb_next
    return tb is not None


def _start_up(w: Worker, t_start: float) -> _Start:
    """Restore (or init), then everything the first step needs ready: data, the compiled step and eval."""
    cfg = w.cfg
    # The step is traced and compiled (a cache hit on a restart) while the checkpoint is read: neither needs
    # the other, and a restart waits for the longer of the two, not their sum.
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compile")
    compiling = pool.submit(_lower_and_compile, w)
    pool.shutdown(wait=False)  # its one task still runs; the thread ends with it
    st, start, tier = _restore_or_init(w)
    if w.primary:  # one line saying where this attempt begins, before any library output
        print(
            outcome.begin_line(
                w.run_dir,
                start,
                steps=cfg.train.steps,
                n_params=w.n_params,
                tier=tier,
                mesh=dict(zip(mesh_lib.AXES, w.mesh.devices.shape)),
                init_from=w.init_from,
            ),
            file=sys.stderr,
            flush=True,
        )
    st = optim.set_hyperparams(st, w.hyperparams)  # runbook.json wins over what the checkpoint holds
    it = data.make_iterator(
        cfg.data,
        corpus=w.corpus,
        seq_len=cfg.model.seq_len,
        steps=cfg.train.steps,
        seed=cfg.run.seed,
        process=jax.process_index(),
        processes=jax.process_count(),
        skips=w.skips,
    )
    it.set_state({"next_index": start})
    feed = data.Feed(it, _audit_log(w, start) if cfg.data.audit else None, mesh_lib.batch_sharding(w.mesh))
    step_fn = _compiled(w, start, compiling)
    ev = evaluate.build(w)  # compiled now too: the first eval is no slow step
    w.marks["ready"] = time.time()
    startup_s = w.marks["ready"] - t_start
    w.events.write(WORKER_READY, step=start, startup_s=startup_s, pid=os.getpid())
    return _Start(st, start, feed, step_fn, ev, startup_s)


def _enter(w: Worker, phase: Phase, step: int) -> None:
    """The heartbeat says the worker entered `phase`; a hang or slow fault of that phase fires here."""
    w.heartbeat.beat(phase, step)
    w.faults.in_phase(phase, step)


def _install_signals(w: Worker, flags: Flags) -> None:
    def handler(signum, frame):  # finish the current step, save, exit PREEMPTED
        flags.stop = True

    signal.signal(signal.SIGTERM, handler)
    # The supervisor sends SIGUSR1 before killing a hung worker: dump every thread's Python stack.
    stacks = rundir.stack_file(w.run_dir, os.getpid())
    stacks.parent.mkdir(exist_ok=True)
    # Open for the process's lifetime: faulthandler keeps a reference to the file while the handler is registered.
    faulthandler.register(signal.SIGUSR1, file=open(stacks, "w"), all_threads=True)


def _newest_durable(w: Worker) -> int:
    return ([0, *committed_steps(durable_dir(w.run_dir, w.cfg.checkpoint.durable_dir))])[-1]


def _restore_or_init(w: Worker):
    # The phase's step is the newest committed durable checkpoint (0: none): what `status` shows while it is
    # read, and what a restore-phase fault compares with (one at step S fires in a restore of S or later).
    _enter(w, Phase.RESTORE, _newest_durable(w))
    t0, w.marks["restoring"] = time.perf_counter(), time.time()
    try:
        restored = w.ckpt.restore_newest(
            w.spec.abstract,
            layout={"processes": jax.process_count(), "mesh": dict(zip(mesh_lib.AXES, w.mesh.devices.shape))},
        )
    except checkpoint.SaveFailed:  # a bucket that did not answer: a storage failure, the supervisor retries
        endings.storage_exit(w, _newest_durable(w))
    w.marks["restored"] = time.time()
    if restored is None:
        st = w.spec.init()
        if w.init_from:  # fine-tuning: another run's params, this run's fresh optimizer state, RNG and schedule
            st = dict(st, params=weights.init_params(w.init_from, w.cfg.model, w.spec.abstract["params"]))
        w.events.write(INIT, step=0, n_params=w.n_params, seconds=time.perf_counter() - t0)
        if w.init_from:
            w.events.write(INIT_FROM, step=0, **w.init_from)
        return st, 0, None
    where = {"sources": restored.sources} if restored.sources else {}
    w.events.write(RESTORE, step=restored.step, tier=restored.tier, seconds=time.perf_counter() - t0, **where)
    assert int(restored.data_state["next_index"]) == restored.step, "data cursor and step disagree"
    return restored.state, restored.step, restored.tier


def _audit_log(w: Worker, start: int) -> AuditLog:
    windows = len(data.TokenWindows.of(w.corpus, w.cfg.model.seq_len))
    return AuditLog(
        w.run_dir,
        process=jax.process_index(),
        processes=jax.process_count(),
        start=start,
        skips=w.skips,
        global_batch=w.cfg.data.batch_size,
        epoch_windows=windows,
    )


def _lower_and_compile(w: Worker):
    """The train step compiled ahead of time (a cache hit on restart), shardings fixed; and its seconds."""
    t0 = time.perf_counter()
    compiled = lower_train_step(w.spec, w.mesh, w.cfg, microbatches=w.microbatches).compile()
    return compiled, time.perf_counter() - t0


def _compiled(w: Worker, start: int, compiling: concurrent.futures.Future):
    """The compiled step, once the compile begun beside the restore is done (the compile phase: what is left)."""
    _enter(w, Phase.COMPILE, start)
    compiled, seconds = compiling.result()
    w.events.write(COMPILED, step=start, seconds=seconds, microbatches=w.microbatches, **runtime(w.cfg))
    return compiled


def runtime(cfg: Config) -> dict:
    """What this attempt's step runs on and with: the attention implementation model.attention resolved to on
    this backend (cudnn | xla | xla_remat), the device kind and platform, and the XLA flags and GPU memory
    fraction in force (trainer.xla_env: the run's own and the user's). In the `compiled` event and the
    checkpoint metadata; `status` shows it."""
    device = jax.devices()[0]
    return {
        "attention": attention_impl(cfg.model, jax.default_backend()),
        "platform": device.platform,
        "device_kind": device.device_kind,
        **xla_env.in_force(),
    }


def _train(w: Worker, flags: Flags, begin: _Start) -> int:
    cfg, st, start, ev = w.cfg, begin.state, begin.step, begin.ev
    stop_at = cfg.train.stop_at_step or cfg.train.steps
    restart_s = _measured_restart_s(w) or begin.seconds
    policy = SavePolicy(
        cfg.checkpoint, steps=cfg.train.steps, stop_at=stop_at, devices=jax.device_count(), restart_s=restart_s
    )
    log = StepLog(w, flags, start=start)
    # Every process stops, saves, exits or holds at the same step; a multi-process group acts agree.LAG
    # steps after the request.
    group = agree.Agreement(Shared, processes=jax.process_count(), start=start)
    step = last_good = start  # last_good: the last step whose replicas agreed (a restored state agrees)
    while step < stop_at:
        w.heartbeat.beat(Phase.STEP, step)
        w.faults.before_step(step)
        batch, data_wait = begin.feed.next(step)
        st = _set_lr_scale(w, flags, st, step)
        if w.faults.bitflip(step):
            st = _bitflip(st, step)
        t0 = time.perf_counter()
        st, m = begin.step_fn(st, batch, w.lrs[step])
        step += 1
        log.dispatched(step, m, data_wait, time.perf_counter() - t0)  # emits the previous step's metrics
        if ev is not None and step % cfg.eval.every_steps == 0:
            log.eval_s = _eval(w, ev, st, step)
        # The agreement is not counted as waiting on peers: it reads a key every process published LAG steps ago
        # (peers wait for a lagging one in reading the step's results). It is an RPC to the coordination
        # service paid by every process: host time, which cancels out between processes, where counted as wait
        # it would fill the straggler watch's "host-bound" line on a fast step.
        shared, save = _agree(w, flags, group, policy, step)
        if shared.spike:
            return endings.spike_exit(w, flags)
        if shared.failed:
            return endings.storage_exit(w, step)
        if _replicas_due(w, step, saving=save is not None):  # a state is checked before it is saved
            if (bad := w.replicas.check(st["params"])) is not None:
                return endings.replica_exit(w, step, last_good, bad)
            last_good = step
        if save is not None and (code := _checkpoint(w, flags, policy, log, st, step, save)) is not None:
            return code
        if shared.stop:
            break
    loss = log.flush()
    if flags.spike is not None:  # a spike in the last steps: no final save, the runbook rewinds instead
        return endings.spike_exit(w, flags)
    return endings.end(w, flags, st, step, loss)


def _agree(
    w: Worker, flags: Flags, group: agree.Agreement, policy: SavePolicy, step: int
) -> tuple[Shared, Save | None]:
    """This process's flags and time-based save requests, exchanged: what every process acts on now, and
    the save (if any) that follows from it, the same on every process."""
    due = policy.requests(local=w.ckpt.has_local)
    shared = group.exchange(
        step,
        Shared(
            spike=flags.spike is not None,
            stop=flags.stop,
            save_now=bool(flags.save_now),
            timed=due.durable,
            hold=flags.hold_asked,
            local_timed=due.local,
            failed=bool(w.ckpt.failure()),
        ),
    )
    w.ckpt.drop_failed_local()  # a local save that failed in the background: an event, the local tier off
    flags.stop |= shared.stop  # a peer's SIGTERM stops this process too; a signal landing meanwhile is kept
    flags.hold = shared.hold
    save = policy.decide(
        step,
        agreed=Requests(durable=shared.timed, local=shared.local_timed),
        stop=shared.stop,
        asked=(flags.save_now or "requested") if shared.save_now else "",
        hold=flags.hold,  # never save a spike
        local=w.ckpt.has_local,
    )
    return shared, save


def _checkpoint(w: Worker, flags: Flags, policy: SavePolicy, log: StepLog, st, step: int, save: Save) -> int | None:
    """Start the save the policy decided; an exit code when the durable tier could not be written."""
    if (blocking := _save(w, st, step, save.reason, save.tier)) is None:
        return endings.storage_exit(w, step)
    log.ckpt_s = blocking
    minutes = policy.saved(save, blocking)
    if save.tier == DURABLE:
        flags.save_now = ""
        if minutes is not None:
            w.events.write(
                CHECKPOINT_INTERVAL, step=step, minutes=minutes, blocking_s=blocking, restart_s=policy.restart_s
            )
    return None


def _meta(w: Worker) -> dict:
    return {
        "config": to_dict(w.cfg),
        "data_fingerprint": w.corpus.fingerprint,
        "data_source": w.corpus.source,
        "n_tokens": w.corpus.n_tokens,
        "mesh": dict(zip(mesh_lib.AXES, w.mesh.devices.shape)),
        "processes": jax.process_count(),
        "devices": jax.device_count(),
        "skips": w.skips,
        "versions": versions(),
        **runtime(w.cfg),  # attention, device, XLA flags (run.deterministic's, and any the user set)
        "init_from": w.init_from,  # where the params started (train.init_from), kept through resumes
    }


def _save(w: Worker, st, step: int, reason: str, tier: str) -> float | None:
    """Start a save into one tier: its blocking seconds, or None when a durable save could not be written."""
    _enter(w, Phase.CHECKPOINT, step)
    if tier == DURABLE:
        w.faults.disk_full(step, w.ckpt)
    try:
        blocking = w.ckpt.save(step, st, {"next_index": step}, _meta(w), tier=tier)
    except checkpoint.SaveFailed:
        return None
    if blocking is None:  # the local tier failed and is off now (an event says so); the durable one carries on
        return 0.0
    w.events.write(CHECKPOINT_SAVED, step=step, blocking_s=blocking, reason=reason, tier=tier)
    w.faults.after_save_started(step)
    return blocking


def _replicas_due(w: Worker, step: int, *, saving: bool) -> bool:
    return w.replicas is not None and (saving or step % w.cfg.integrity.replica_check_steps == 0)


def _bitflip(st, step: int):
    """The bitflip fault: one bit of one replica's copy of one param (silent data corruption)."""
    st, flipped = replicas.bitflip(st)
    if flipped:
        print(f"worker: fault bitflip before step {step}: {flipped}", file=sys.stderr, flush=True)
    return st


def _eval(w: Worker, ev: evaluate.Evaluator, st, step: int) -> float:
    """The held-out loss after `step` updates: event `eval` and TensorBoard loss/eval. A heartbeat phase of
    its own (supervisor.eval_timeout_s): a long eval is no hung step."""
    _enter(w, Phase.EVAL, step)
    r = ev.run(st["params"])
    w.heartbeat.beat(Phase.STEP, step)
    w.events.write(EVAL, step=step, **r)
    w.scalars.add(step, {"loss/eval": r["loss"], "loss/eval_perplexity": r["perplexity"]})
    return r["seconds"]


def _set_lr_scale(w: Worker, flags: Flags, st, step: int):
    """While a spike is probed the updates are frozen (LR scale 0); nan/spike faults poison one update.
    Only the scalar changes, so the compiled step is the same."""
    want = 0.0 if flags.hold else w.faults.lr_scale(step, w.hyperparams["lr_scale"])
    if want != flags.lr_scale_now:  # NaN != NaN: a nan fault is set, and the next step puts the scale back
        st = optim.set_hyperparams(st, {"lr_scale": want})
        flags.lr_scale_now = want
    return st


def _measured_restart_s(w: Worker) -> float | None:
    """Mean recovery time of this run so far (from the supervisor's ledger), for the "auto" interval; None
    before the first recovery, when this attempt's own start-up time stands in for it (a lower bound: a
    real restart adds detection and relaunch)."""
    rec = (summary.read(w.run_dir) or {}).get("recoveries_s", [])
    return sum(rec) / len(rec) if rec else None
