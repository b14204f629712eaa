"""The worker: restore-or-init, then the training loop's cadence (step, log, save, heartbeat, stop).

Exit codes are in trainer.exit_codes. The loop dispatches step n before reading step n-1's
metrics, so the host never waits on the device except one step behind.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import importlib.metadata
import json
import os
import signal
import time
from pathlib import Path

import absl.logging
import jax
import numpy as np

from trainer import alerts, checkpoint, data, exit_codes, metrics, optim, runbook
from trainer import audit as audit_lib
from trainer import mesh as mesh_lib
from trainer import state as state_lib
from trainer.config import Config, ConfigError, dump_yaml, to_dict
from trainer.faults import FaultInjector
from trainer.heartbeat import Heartbeat
from trainer.model import GPT, flops_per_token
from trainer.step import make_train_step

absl.logging.set_verbosity(absl.logging.ERROR)  # Orbax's info/warnings would drown the progress line

# Keys whose change makes a checkpoint meaningless for this run: refuse to resume.
FROZEN_KEYS = ("model", "data.batch_size", "data.shuffle", "run.seed")


def setup_compile_cache(path: str) -> None:
    if not path:
        return
    jax.config.update("jax_compilation_cache_dir", str(Path(path).expanduser()))
    # Cache every executable, however small or quick to build: a restart should never recompile.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def _dig(tree: dict, dotted: str):
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def check_resume(saved: dict, cfg: Config, fingerprint: str) -> list[str]:
    """Refuse a resume that would change what the checkpoint means; list the harmless changes."""
    now = to_dict(cfg)
    for key in FROZEN_KEYS:
        if _dig(saved["config"], key) != _dig(now, key):
            raise ConfigError(
                f"cannot resume {cfg.run.dir}: {key} changed from {_dig(saved['config'], key)!r} to "
                f"{_dig(now, key)!r}; use a new run.dir or restore the old value")
    if saved["data_fingerprint"] != fingerprint:
        raise ConfigError(
            f"cannot resume {cfg.run.dir}: the training data changed (fingerprint "
            f"{saved['data_fingerprint'][:12]} -> {fingerprint[:12]}); point data.path at the original corpus")
    changes = []
    for section, values in now.items():
        old = saved["config"].get(section)
        if old != values and section != "faults":
            changes.append(f"{section}: {old} -> {values}")
    return changes


def validate_shapes(cfg: Config, mesh_shape: tuple[int, int, int], processes: int) -> None:
    data_par, _, tensor = mesh_shape
    if cfg.model.vocab_size < data.TOKENIZER_VOCAB:
        raise ConfigError(
            f"model.vocab_size ({cfg.model.vocab_size}) must be >= {data.TOKENIZER_VOCAB} (byte tokenizer)")
    for key, v in (("model.vocab_size", cfg.model.vocab_size), ("model.n_heads", cfg.model.n_heads),
                   ("model.d_ff", cfg.model.d_ff or 4 * cfg.model.d_model)):
        if v % tensor:
            raise ConfigError(f"{key} ({v}) must be divisible by mesh.tensor ({tensor})")
    shards = data_par * mesh_shape[1]
    if cfg.data.batch_size % shards or cfg.data.batch_size % processes:
        raise ConfigError(f"data.batch_size ({cfg.data.batch_size}) must be divisible by data x fsdp ({shards})"
                          f" and by the process count ({processes})")


def _versions() -> dict:
    out = {}
    for pkg in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "numpy"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


@dataclasses.dataclass
class Worker:
    """Everything the loop touches, built once by `setup`."""

    cfg: Config
    run_dir: Path
    primary: bool
    corpus: data.Corpus
    mesh: object
    spec: state_lib.StateSpec
    ckpt: checkpoint.Checkpointer
    events: metrics.EventLog
    scalars: metrics.Scalars
    heartbeat: Heartbeat
    faults: FaultInjector
    skips: list[int]
    n_params: int
    stop_requested: bool = False
    stacks_file: object = None
    save_requested: str = ""  # a monitor asked for a checkpoint now (e.g. rising ECC count)
    spike: dict | None = None  # a monitor found a loss spike: exit SPIKE for the runbook
    hold: bool = False  # a spike is being probed: updates frozen (LR scale 0), no saves
    hyperparams: dict = dataclasses.field(default_factory=dict)  # the runbook's lr_scale, clip_norm, b2
    lr_scale_now: float = 1.0  # the LR scale in the device state (hold and nan/spike faults change it)
    # Observers of each step's metrics: objects with on_step(step, rec) -> Action | None.
    monitors: list = dataclasses.field(default_factory=list)
    audit: audit_lib.AuditLog | None = None  # data.audit: every step's global sample ids, per process


def _read_saved_meta(ckpt_dir: Path, cfg: Config) -> dict | None:
    if not ckpt_dir.is_dir():
        return None
    reader = checkpoint.Checkpointer(ckpt_dir, cfg.checkpoint, read_only=True)
    steps = reader.steps()
    return reader.read_meta(steps[-1]) if steps else None


def setup(cfg: Config) -> Worker:
    """Validate everything that can be wrong before the first write to the run dir."""
    run_dir = Path(cfg.run.dir)
    corpus = data.prepare(cfg.data)
    shape = mesh_lib.mesh_shape(cfg.mesh, jax.device_count())
    validate_shapes(cfg, shape, jax.process_count())
    ckpt_dir = run_dir / "checkpoints"
    saved = _read_saved_meta(ckpt_dir, cfg)
    changes = check_resume(saved, cfg, corpus.fingerprint) if saved else []

    primary = jax.process_index() == 0
    run_dir.mkdir(parents=True, exist_ok=True)
    setup_compile_cache(cfg.run.compile_cache)
    events = metrics.EventLog(run_dir / "events.jsonl", enabled=primary)
    rb = runbook.RunbookState.load(run_dir, cfg.optim)
    if primary:  # as trained: with the runbook's softened LR, clip and b2, if it softened them
        (run_dir / "config.yaml").write_text(dump_yaml(runbook.softened_config(cfg, rb)))
    for c in changes:
        events.write("config_changed", change=c)
    mesh = mesh_lib.make_mesh(cfg.mesh)
    model = GPT(cfg.model)
    tx = optim.make_optimizer(cfg.optim, cfg.train.steps)
    spec = state_lib.build(model, tx, mesh, seed=cfg.run.seed, seq_len=cfg.model.seq_len)
    scalars = metrics.Scalars(run_dir / "tb", enabled=primary and cfg.log.tensorboard)
    if primary and not saved:
        scalars.text("config", "```\n" + dump_yaml(cfg) + "\n```")
        scalars.hparams(to_dict(cfg), metric_tags=("loss/train", "throughput/tokens_per_s", "throughput/mfu"))
    w = Worker(
        cfg=cfg, run_dir=run_dir, primary=primary, corpus=corpus, mesh=mesh, spec=spec,
        ckpt=checkpoint.Checkpointer(ckpt_dir, cfg.checkpoint, pinned=lambda steps: runbook.retention_pins(
            steps, window=cfg.runbook.window if cfg.runbook.enabled else None, pinned=rb.pinned)),
        events=events, scalars=scalars, heartbeat=Heartbeat(run_dir, jax.process_index()),
        faults=FaultInjector(cfg.faults, run_dir, enabled=primary), skips=rb.skips,
        n_params=state_lib.param_count(spec.abstract), hyperparams=rb.hyperparams(), lr_scale_now=rb.lr_scale,
    )
    # Dashboard: grad-norm trend, throughput drop, hardware health (ECC rising -> checkpoint now), markers.
    w.monitors += alerts.build(cfg, run_dir=run_dir, events=events, scalars=scalars, faults=w.faults)
    if cfg.runbook.enabled:
        w.monitors.append(runbook.SpikeDetector(
            cfg.runbook, log=events.write, batch_of=lambda s: data.batch_index(s - 1, w.skips),
            stop_step=cfg.train.stop_at_step or cfg.train.steps, events_path=run_dir / "events.jsonl"))
    return w


def _restore_or_init(w: Worker):
    w.heartbeat.beat("restore", 0)
    t0 = time.perf_counter()
    restored = w.ckpt.restore_newest(
        w.spec.abstract,
        on_error=lambda step, e: w.events.write("checkpoint_unreadable", step=step, error=repr(e)[:300]))
    if restored is None:
        st = w.spec.init()
        w.events.write("init", step=0, n_params=w.n_params, seconds=time.perf_counter() - t0)
        return st, 0
    w.events.write("restore", step=restored.step, seconds=time.perf_counter() - t0)
    assert int(restored.data_state["next_index"]) == restored.step, "data cursor and step disagree"
    return restored.state, restored.step


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
        "versions": _versions(),
    }


def _save(w: Worker, st, step: int, reason: str) -> float:
    w.heartbeat.beat("checkpoint", step)
    blocking = w.ckpt.save(step, st, {"next_index": step}, _meta(w))
    w.events.write("checkpoint_saved", step=step, blocking_s=blocking, reason=reason)
    w.faults.after_save_started(step)
    return blocking


def _install_signals(w: Worker) -> None:
    def handler(signum, frame):  # finish the current step, save, exit PREEMPTED
        w.stop_requested = True

    signal.signal(signal.SIGTERM, handler)
    # The supervisor sends SIGUSR1 before killing a hung worker: dump every thread's Python stack.
    stacks = w.run_dir / "stacks"
    stacks.mkdir(exist_ok=True)
    w.stacks_file = open(stacks / f"worker-{os.getpid()}.txt", "w")
    faulthandler.register(signal.SIGUSR1, file=w.stacks_file, all_threads=True)


def _agree(flags: list[bool]) -> list[bool]:
    """All processes must stop, save or rewind together: any process's request wins. One small
    host collective per step carries every flag."""
    if jax.process_count() == 1:
        return flags
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(np.array(flags, np.int32))
    return [bool(v) for v in np.max(gathered.reshape(-1, len(flags)), axis=0)]


def run(cfg: Config) -> int:
    t_start = time.time()
    w = setup(cfg)
    _install_signals(w)
    w.heartbeat.beat("startup", 0)
    st, start = _restore_or_init(w)
    st = optim.set_hyperparams(st, w.hyperparams)  # runbook.json wins over what the checkpoint holds
    it = data.make_iterator(cfg.data, corpus=w.corpus, seq_len=cfg.model.seq_len, steps=cfg.train.steps,
                            seed=cfg.run.seed, process=jax.process_index(), processes=jax.process_count(),
                            skips=w.skips)
    it.set_state({"next_index": start})
    if cfg.data.audit:
        w.audit = audit_lib.AuditLog(
            w.run_dir, process=jax.process_index(), processes=jax.process_count(), start=start, skips=w.skips,
            global_batch=cfg.data.batch_size, epoch_windows=len(data.TokenWindows(w.corpus.tokens_path,
                                                                                 cfg.model.seq_len)))
    bsh = mesh_lib.batch_sharding(w.mesh)
    sched = optim.schedule(cfg.optim, cfg.train.steps)
    step_fn = make_train_step(w.spec, bsh, mesh_lib.replicated(w.mesh), sched)
    w.heartbeat.beat("compile", start)
    t0 = time.perf_counter()
    tokens_shape = jax.ShapeDtypeStruct((cfg.data.batch_size, cfg.model.seq_len + 1), np.int32, sharding=bsh)
    compiled = step_fn.lower(w.spec.abstract, tokens_shape).compile()
    w.events.write("compiled", step=start, seconds=time.perf_counter() - t0)
    w.events.write("worker_ready", step=start, startup_s=time.time() - t_start, pid=os.getpid())
    code = _train(w, compiled, it, st, start)
    w.events.close()
    w.scalars.close()
    if w.primary and cfg.log.report and "TRAINER_ATTEMPT" not in os.environ:  # unsupervised: no one else will
        from trainer import report

        report.write_safely(w.run_dir)
    return code


def _train(w: Worker, step_fn, it, st, start: int) -> int:
    cfg = w.cfg
    tokens_per_step = cfg.data.batch_size * cfg.model.seq_len
    fpt = flops_per_token(cfg.model, w.n_params)
    peak = metrics.peak_flops(cfg.log.peak_flops) * jax.device_count()
    progress = metrics.Progress(cfg.train.steps, cfg.log.progress and w.primary)
    bsh = mesh_lib.batch_sharding(w.mesh)
    stop_at = cfg.train.stop_at_step or cfg.train.steps
    policy = checkpoint.SavePolicy(cfg.checkpoint, devices=jax.device_count(), restart_s=_measured_restart_s(w.run_dir))
    pending = None  # (step number, metrics future, data wait s, ckpt blocking s) read one step late
    t_prev = time.perf_counter()
    loss = float("nan")
    step = start
    while step < stop_at:
        w.heartbeat.beat("step", step)
        w.faults.before_step(step)
        t_data = time.perf_counter()
        local = next(it)
        batch = jax.make_array_from_process_local_data(bsh, local["tokens"])
        data_wait = time.perf_counter() - t_data
        if w.audit:
            w.audit.record(step, local)
        st = _set_lr_scale(w, st, step)
        st, m = step_fn(st, batch)
        step += 1
        if pending:
            loss, t_prev = _emit(w, pending, t_prev, tokens_per_step, fpt, peak, progress)
        pending = (step, m, data_wait, 0.0)
        periodic, timed = policy.due(step)
        spike, stop, asked, timed, w.hold = _agree(
            [w.spike is not None, w.stop_requested, bool(w.save_requested), timed, w.hold])
        if spike:
            return _spike_exit(w)
        if not w.hold and (stop or asked or timed or periodic or step == stop_at):  # never save a spiked state
            reason = ("preempt" if stop else "final" if step == cfg.train.steps else "stop" if step == stop_at
                      else w.save_requested or "requested" if asked else "periodic")
            w.save_requested = ""
            pending = pending[:3] + (_save(w, st, step, reason),)
            if (minutes := policy.saved(pending[3])) is not None:
                w.events.write("checkpoint_interval", step=step, minutes=minutes, blocking_s=pending[3])
        if stop:
            break
    if pending:
        loss, _ = _emit(w, pending, t_prev, tokens_per_step, fpt, peak, progress)
    if w.spike is not None:  # a spike in the last steps: no final save, the runbook rewinds instead
        return _spike_exit(w)
    progress.done()
    w.heartbeat.beat("checkpoint", step)
    w.ckpt.close()  # durable before we report anything as saved
    if w.stop_requested:
        w.events.write("preempted", step=step)
        return exit_codes.PREEMPTED
    if step < cfg.train.steps:
        w.events.write("stopped", step=step)
        return exit_codes.OK
    _finish(w, st, step, loss)
    return exit_codes.OK


def _spike_exit(w: Worker) -> int:
    """Leave without saving: the state after a spike is what the runbook rewinds away from."""
    w.events.write("spike_exit", step=(w.spike or {}).get("step"), **{k: v for k, v in (w.spike or {}).items()
                                                                     if k not in ("do", "step")})
    w.ckpt.close()  # let saves of earlier, good steps finish
    w.events.close()
    return exit_codes.SPIKE


def _emit(w: Worker, pending, t_prev: float, tokens_per_step: int, fpt: float, peak: float, progress):
    step, m, data_wait, ckpt_s = pending
    m = {k: float(v) for k, v in jax.device_get(m).items()}
    now = time.perf_counter()
    dt = now - t_prev
    tps = tokens_per_step / dt
    rec = dict(m, tokens_per_s=tps, step_s=dt, data_wait_s=data_wait, ckpt_block_s=ckpt_s)
    if peak:
        rec["mfu"] = tps * fpt / peak
    w.events.write("step", step=step, **rec)
    for mon in w.monitors:
        action = mon.on_step(step, rec)
        if action is not None:
            _act(w, step, action)
    if step % w.cfg.log.every_steps == 0:
        w.scalars.add(step, {
            "loss/train": m["loss"], "optim/grad_norm": m["grad_norm"], "optim/update_norm": m["update_norm"],
            "optim/lr": m["lr"], "throughput/tokens_per_s": tps, "time/step_s": dt, "time/data_wait_s": data_wait,
            "time/ckpt_block_s": ckpt_s, "time/compute_s": max(dt - data_wait - ckpt_s, 0.0),
            **({"throughput/mfu": rec["mfu"]} if peak else {}),
        })
        progress.update(step, m["loss"], tps, dt)
    return m["loss"], now


def _act(w: Worker, step: int, action: dict) -> None:
    """Monitors answer with {"do": "checkpoint_now" | "hold" | "spike", ...}; the loop carries it out."""
    if action["do"] == "checkpoint_now":
        w.save_requested = action.get("reason", "requested")
    elif action["do"] == "spike":
        w.spike = dict(action, step=step)
    elif action["do"] == "hold":
        w.hold = True


def _set_lr_scale(w: Worker, st, step: int):
    """While a spike is probed the updates are frozen (LR scale 0); nan/spike faults poison one update.
    Only the scalar changes, so the compiled step is the same."""
    want = 0.0 if w.hold else w.faults.lr_scale(step, w.hyperparams["lr_scale"])
    if want != w.lr_scale_now:  # NaN != NaN: a nan fault is set, and the next step puts the scale back
        st = optim.set_hyperparams(st, {"lr_scale": want})
        w.lr_scale_now = want
    return st


def _finish(w: Worker, st, step: int, loss: float) -> None:
    digest = metrics.params_sha256(st["params"])
    if w.primary:
        summary = {"final_step": step, "final_loss": loss, "params_sha256": digest, "n_params": w.n_params,
                   "data_fingerprint": w.corpus.fingerprint}
        prev = w.run_dir / "summary.json"
        # wall_s spans the whole run: the supervisor's ledger (if any) replaces this worker-only figure.
        first = _first_event_time(w.run_dir)
        summary["wall_s"] = time.time() - first
        prev.write_text(json.dumps(summary, indent=1))
    w.events.write("run_complete", step=step, final_loss=loss, params_sha256=digest)
    w.heartbeat.beat("done", step)


def _measured_restart_s(run_dir: Path) -> float:
    """Mean recovery time of this run so far (from the supervisor's ledger), for the "auto" interval."""
    p = run_dir / "summary.json"
    rec = json.loads(p.read_text()).get("recoveries_s", []) if p.is_file() else []
    return sum(rec) / len(rec) if rec else 60.0


def _first_event_time(run_dir: Path) -> float:
    with open(run_dir / "events.jsonl") as fh:
        return json.loads(fh.readline())["time"]
