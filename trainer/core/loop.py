"""The worker loop: restore-or-init, compile, then the cadence of every step (heartbeat, data, step, log,
save, stop). Exit codes are in trainer.supervise.exit_codes.

The loop dispatches step n before reading step n-1's metrics, so the host never waits on the device
except one step behind.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import signal
import sys
import time
from pathlib import Path

import absl.logging
import jax

from trainer.config import Config, to_dict
from trainer.core import agree, checkpoint, data, evaluate, integrity, optim, weights
from trainer.core import mesh as mesh_lib
from trainer.core.model import flops_per_token
from trainer.core.state import params_sha256
from trainer.core.step import lower_train_step
from trainer.core.worker import Worker, setup, versions
from trainer.observe import outcome, rundir
from trainer.observe.audit import AuditLog
from trainer.observe.events import iter_events, newest_record
from trainer.observe.progress import Progress
from trainer.supervise import exit_codes

absl.logging.set_verbosity(absl.logging.ERROR)  # Orbax's info/warnings would drown the progress line
_STACKS_FILE = None
TRAINING = False  # past start-up: an exception now is more likely a peer's death seen through a collective


@dataclasses.dataclass
class Flags:
    """What changes while the loop runs: set by the SIGTERM handler and by monitors' actions."""

    stop: bool = False  # SIGTERM: finish the step, save, exit PREEMPTED
    save_now: str = ""  # a monitor asked for a checkpoint now (e.g. rising ECC count): its reason
    spike: dict | None = None  # a monitor found a loss spike: exit SPIKE for the runbook
    hold_asked: bool = False  # a monitor asked to freeze updates while it probes a spike
    hold: bool = False  # the group agreed to hold: updates frozen (LR scale 0), no saves
    lr_scale_now: float = 1.0  # the LR scale in the device state (hold and nan/spike faults change it)

    def act(self, step: int, action: dict) -> None:
        """Monitors answer with {"do": "checkpoint_now" | "hold" | "spike", ...}; the loop carries it out."""
        if action["do"] == "checkpoint_now":
            self.save_now = action.get("reason", "requested")
        elif action["do"] == "spike":
            self.spike = dict(action, step=step)
        elif action["do"] == "hold":
            self.hold_asked = True


def run(cfg: Config) -> int:
    t_start = time.time()
    w = setup(cfg)
    flags = Flags(lr_scale_now=w.hyperparams["lr_scale"])
    _install_signals(w, flags)
    _enter(w, "startup", 0)
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
    audit = _audit_log(w, start) if cfg.data.audit else None
    step_fn = _compile(w, start)
    ev = evaluate.build(w)  # compiled now too: the first eval is no slow step
    w.events.write("worker_ready", step=start, startup_s=time.time() - t_start, pid=os.getpid())
    global TRAINING
    TRAINING = True
    code = _train(w, flags, step_fn, it, audit, st, start, ev)
    w.events.close()
    w.scalars.close()
    if "TRAINER_ATTEMPT" not in os.environ:  # unsupervised: no one else will tidy up, report or say the end
        rundir.drop_empty_stacks(w.run_dir, [os.getpid()])
        if w.primary and cfg.log.report:
            from trainer.observe import report

            report.write_safely(w.run_dir)
        if w.primary and code == exit_codes.OK and (line := outcome.end_line(w.run_dir)):
            print(line, file=sys.stderr)
    return code


def _enter(w: Worker, phase: str, step: int) -> None:
    """The heartbeat says the worker entered `phase`; a hang or slow fault of that phase fires here."""
    w.heartbeat.beat(phase, step)
    w.faults.in_phase(phase, step)


def _install_signals(w: Worker, flags: Flags) -> None:
    def handler(signum, frame):  # finish the current step, save, exit PREEMPTED
        flags.stop = True

    signal.signal(signal.SIGTERM, handler)
    # The supervisor sends SIGUSR1 before killing a hung worker: dump every thread's Python stack.
    stacks = w.run_dir / rundir.STACKS
    stacks.mkdir(exist_ok=True)
    global _STACKS_FILE  # open for the process's lifetime: the handler writes into it at any moment
    _STACKS_FILE = open(stacks / f"worker-{os.getpid()}.txt", "w")
    faulthandler.register(signal.SIGUSR1, file=_STACKS_FILE, all_threads=True)


def _restore_or_init(w: Worker):
    _enter(w, "restore", 0)
    t0 = time.perf_counter()
    restored = w.ckpt.restore_newest(
        w.spec.abstract,
        layout={"processes": jax.process_count(), "mesh": dict(zip(mesh_lib.AXES, w.mesh.devices.shape))},
    )
    if restored is None:
        st = w.spec.init()
        if w.init_from:  # fine-tuning: another run's params, this run's fresh optimizer state, RNG and schedule
            st = dict(st, params=weights.restore_params(Path(w.init_from["checkpoint"]), w.spec.abstract["params"]))
        w.events.write("init", step=0, n_params=w.n_params, seconds=time.perf_counter() - t0)
        if w.init_from:
            w.events.write("init_from", step=0, **w.init_from)
        return st, 0, None
    w.events.write("restore", step=restored.step, tier=restored.tier, seconds=time.perf_counter() - t0)
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


def _compile(w: Worker, start: int):
    """The train step compiled ahead of time (a cache hit on restart), shardings fixed."""
    _enter(w, "compile", start)
    t0 = time.perf_counter()
    compiled = lower_train_step(w.spec, w.mesh, w.cfg, microbatches=w.microbatches).compile()
    w.events.write("compiled", step=start, seconds=time.perf_counter() - t0, microbatches=w.microbatches)
    return compiled


def _train(
    w: Worker, flags: Flags, step_fn, it, audit: AuditLog | None, st, start: int, ev: evaluate.Evaluator | None
) -> int:
    cfg = w.cfg
    bsh = mesh_lib.batch_sharding(w.mesh)
    stop_at = cfg.train.stop_at_step or cfg.train.steps
    policy = checkpoint.SavePolicy(cfg.checkpoint, devices=jax.device_count(), restart_s=_measured_restart_s(w))
    log = _StepLog(w, flags)
    # Every process stops, saves, exits or holds at the same step; a multi-process group acts agree.LAG
    # steps after the request. Checkpoint-now and timed saves (durable and local) are one-shot requests.
    agreement = agree.Agreement(processes=jax.process_count(), start=start, n_flags=7, one_shot=(2, 3, 5))
    step = last_good = start  # last_good: the last step whose replicas agreed (a restored state agrees)
    while step < stop_at:
        w.heartbeat.beat("step", step)
        w.faults.before_step(step)
        t_data = time.perf_counter()
        local = next(it)
        batch = jax.make_array_from_process_local_data(bsh, local["tokens"])
        data_wait = time.perf_counter() - t_data
        if audit:
            audit.record(step, local)
        st = _set_lr_scale(w, flags, st, step)
        if w.faults.bitflip(step):
            st = _bitflip(st, step)
        st, m = step_fn(st, batch)
        step += 1
        log.dispatched(step, m, data_wait)  # emits the previous step's metrics: they are ready by now
        if ev is not None and step % cfg.eval.every_steps == 0:
            log.eval_s = _eval(w, ev, st, step)
        periodic, timed = policy.due(step)
        to_local, local_timed = w.ckpt.local_due(step)
        spike, stop, asked, timed, flags.hold, local_timed, failed = agreement.exchange(
            step,
            [
                flags.spike is not None,
                flags.stop,
                bool(flags.save_now),
                timed,
                flags.hold_asked,
                local_timed,
                bool(w.ckpt.failure()),
            ],
        )
        flags.stop |= stop  # a peer's SIGTERM stops this process too; a signal landing meanwhile is kept
        if spike:
            return _spike_exit(w, flags)
        if failed:
            return _storage_exit(w, step)
        durable = not flags.hold and (stop or asked or timed or periodic or step == stop_at)  # never save a spike
        to_local = not flags.hold and not durable and (to_local or local_timed)
        if _replicas_due(w, step, saving=durable or to_local):  # a state is checked before it is saved
            if (bad := w.replicas.check(st["params"])) is not None:
                return _replica_exit(w, step, last_good, bad)
            last_good = step
        if durable or to_local:
            reason = _save_reason(stop, flags, cfg, step, stop_at, asked) if durable else "local"
            if (blocking := _save(w, st, step, reason, "durable" if durable else "local")) is None:
                return _storage_exit(w, step)
            log.ckpt_s = blocking
        if durable:
            flags.save_now = ""
            if (minutes := policy.saved(log.ckpt_s)) is not None:
                w.events.write("checkpoint_interval", step=step, minutes=minutes, blocking_s=log.ckpt_s)
        if stop:
            break
    loss = log.flush()
    if flags.spike is not None:  # a spike in the last steps: no final save, the runbook rewinds instead
        return _spike_exit(w, flags)
    return _end(w, flags, st, step, loss)


def _save_reason(stop: bool, flags: Flags, cfg: Config, step: int, stop_at: int, asked: bool) -> str:
    if stop:
        return "preempt"
    if step == cfg.train.steps:
        return "final"
    if step == stop_at:
        return "stop"
    return (flags.save_now or "requested") if asked else "periodic"


def _end(w: Worker, flags: Flags, st, step: int, loss: float) -> int:
    w.heartbeat.beat("checkpoint", step)
    w.ckpt.close()  # durable (and sealed) before we report anything as saved
    if w.ckpt.failure():
        return _storage_exit(w, step)
    if flags.stop:
        w.events.write("preempted", step=step)
        return exit_codes.PREEMPTED
    if step < w.cfg.train.steps:
        w.events.write("stopped", step=step)
        return exit_codes.OK
    _finish(w, st, step, loss)
    return exit_codes.OK


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
        "xla_flags": os.environ.get("XLA_FLAGS", ""),  # run.deterministic's flag, and any the user set
        "init_from": w.init_from,  # where the params started (train.init_from), kept through resumes
    }


def _save(w: Worker, st, step: int, reason: str, tier: str) -> float | None:
    """Start a save into one tier: its blocking seconds, or None when a durable save could not be written."""
    _enter(w, "checkpoint", step)
    try:
        blocking = w.ckpt.save(step, st, {"next_index": step}, _meta(w), tier=tier)
    except checkpoint.SaveFailed:
        return None
    if blocking is None:  # the local tier failed and is off now (an event says so); the durable one carries on
        return 0.0
    w.events.write("checkpoint_saved", step=step, blocking_s=blocking, reason=reason, tier=tier)
    w.faults.after_save_started(step)
    return blocking


def _replicas_due(w: Worker, step: int, *, saving: bool) -> bool:
    return w.replicas is not None and (saving or step % w.cfg.integrity.replica_check_steps == 0)


def _replica_exit(w: Worker, step: int, last_good: int, bad: dict) -> int:
    """Replicas of the params diverged: leave without saving; the supervisor rewinds to a checkpoint saved
    at or before `last_good` (every save was preceded by a check that passed) and restarts."""
    w.events.write("replica_mismatch", step=step, last_good=last_good, **bad)
    odd = [d["device"] for d in bad["devices"] if d["odd"]]
    print(
        f"worker: replicas of {bad['param']} differ at step {step} (devices {odd} of "
        f"{[d['device'] for d in bad['devices']]}); last agreement at step {last_good}",
        file=sys.stderr,
    )
    w.ckpt.close()  # saves of earlier, checked states finish
    w.events.close()
    return exit_codes.REPLICA_MISMATCH


def _storage_exit(w: Worker, step: int) -> int:
    """A checkpoint could not be written: say why and stop (a restart would only fill the disk again). No
    waiting on the failed save: a peer's background writer may wait in a barrier for it until a timeout."""
    msg = w.ckpt.failure() or "a checkpoint could not be written"
    w.events.write("checkpoint_failed", step=step, tier="durable", message=msg)
    print(f"worker: {msg}", file=sys.stderr, flush=True)
    w.events.close()
    w.scalars.close()
    os._exit(exit_codes.STORAGE)


def _bitflip(st, step: int):
    """The bitflip fault: one bit of one replica's copy of one param (silent data corruption)."""
    st, flipped = integrity.bitflip(st)
    if flipped:
        print(f"worker: fault bitflip before step {step}: {flipped}", file=sys.stderr, flush=True)
    return st


def _eval(w: Worker, ev: evaluate.Evaluator, st, step: int) -> float:
    """The held-out loss after `step` updates: event `eval` and TensorBoard loss/eval."""
    r = ev.run(st["params"])
    w.events.write("eval", step=step, **r)
    w.scalars.add(step, {"loss/eval": r["loss"], "loss/eval_perplexity": r["perplexity"]})
    return r["seconds"]


def _spike_exit(w: Worker, flags: Flags) -> int:
    """Leave without saving: the state after a spike is what the runbook rewinds away from."""
    spike = flags.spike or {}
    w.events.write("spike_exit", step=spike.get("step"), **{k: v for k, v in spike.items() if k not in ("do", "step")})
    w.ckpt.close()  # let saves of earlier, good steps finish
    w.events.close()
    return exit_codes.SPIKE


class _StepLog:
    """Each step's metrics, read one step late (by then the device has them): the `step` event, TensorBoard
    scalars every log interval, the progress line, and the monitors, whose actions go to the flags."""

    def __init__(self, w: Worker, flags: Flags):
        cfg = w.cfg
        self.w, self.flags = w, flags
        self.tokens_per_step = cfg.data.batch_size * cfg.model.seq_len
        self.flops_per_token = flops_per_token(cfg.model, w.n_params)
        self.peak = mesh_lib.peak_flops(cfg.log.peak_flops) * jax.device_count()
        self.progress = Progress(cfg.train.steps, cfg.log.progress and w.primary)
        self.pending = None  # (step, metrics on device, data wait s)
        self.ckpt_s = 0.0  # blocking seconds of a save right after the pending step
        self.eval_s = 0.0  # seconds of an eval right after the pending step (left out of its tokens/s)
        self.t_prev = time.perf_counter()
        self.loss: float | None = None  # None: no step ran in this attempt

    def dispatched(self, step: int, m, data_wait: float) -> None:
        if self.pending:
            self._emit(*self.pending)
        self.pending, self.ckpt_s, self.eval_s = (step, m, data_wait), 0.0, 0.0

    def flush(self) -> float:
        if self.pending:
            self._emit(*self.pending)
            self.pending = None
        self.progress.done()
        return self.loss

    def _emit(self, step: int, m, data_wait: float) -> None:
        w, ckpt_s = self.w, self.ckpt_s
        m = {k: float(v) for k, v in jax.device_get(m).items()}
        now = time.perf_counter()
        dt, self.t_prev = now - self.t_prev, now
        tps = self.tokens_per_step / max(dt - self.eval_s, 1e-9)
        rec = dict(m, tokens_per_s=tps, step_s=dt, data_wait_s=data_wait, ckpt_block_s=ckpt_s)
        if self.eval_s:
            rec["eval_s"] = self.eval_s
        if self.peak:
            rec["mfu"] = tps * self.flops_per_token / self.peak
        w.events.write("step", step=step, **rec)
        for mon in w.monitors:
            if (action := mon.on_step(step, rec)) is not None:
                self.flags.act(step, action)
        if step % w.cfg.log.every_steps == 0:
            w.scalars.add(
                step,
                {
                    "loss/train": m["loss"],
                    "optim/grad_norm": m["grad_norm"],
                    "optim/update_norm": m["update_norm"],
                    "optim/lr": m["lr"],
                    "throughput/tokens_per_s": tps,
                    "time/step_s": dt,
                    "time/data_wait_s": data_wait,
                    "time/ckpt_block_s": ckpt_s,
                    "time/compute_s": max(dt - data_wait - ckpt_s, 0.0),
                    **({"throughput/mfu": rec["mfu"]} if self.peak else {}),
                },
            )
        self.progress.update(step, m["loss"], tps, dt)
        self.loss = m["loss"]


def _set_lr_scale(w: Worker, flags: Flags, st, step: int):
    """While a spike is probed the updates are frozen (LR scale 0); nan/spike faults poison one update.
    Only the scalar changes, so the compiled step is the same."""
    want = 0.0 if flags.hold else w.faults.lr_scale(step, w.hyperparams["lr_scale"])
    if want != flags.lr_scale_now:  # NaN != NaN: a nan fault is set, and the next step puts the scale back
        st = optim.set_hyperparams(st, {"lr_scale": want})
        flags.lr_scale_now = want
    return st


def _finish(w: Worker, st, step: int, loss: float | None) -> None:
    if loss is None:  # restored the final checkpoint (killed before this ran): the loss was logged back then
        loss = (newest_record(w.run_dir / rundir.EVENTS, "step", step) or {}).get("loss")
    digest = params_sha256(st["params"])
    if w.primary:
        summary = {
            "final_step": step,
            "final_loss": loss,
            "params_sha256": digest,
            "n_params": w.n_params,
            "data_fingerprint": w.corpus.fingerprint,
        }
        # wall_s spans the whole run: the supervisor's ledger (if any) replaces this worker-only figure.
        first = next(iter_events(w.run_dir / rundir.EVENTS))["time"]
        summary["wall_s"] = time.time() - first
        rundir.write_json(w.run_dir / rundir.SUMMARY, summary)
    w.events.write("run_complete", step=step, final_loss=loss, params_sha256=digest)
    w.heartbeat.beat("done", step)


def _measured_restart_s(w: Worker) -> float:
    """Mean recovery time of this run so far (from the supervisor's ledger), for the "auto" interval."""
    rec = (rundir.read_json(w.run_dir / rundir.SUMMARY) or {}).get("recoveries_s", [])
    return sum(rec) / len(rec) if rec else 60.0
