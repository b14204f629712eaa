"""Building a worker: everything that can be wrong is checked before the first write to the run dir,
then the parts the loop uses are built once (mesh, state spec, checkpointer, writers, monitors).

What changes while the loop runs lives apart, in `Flags` (trainer.train.loop).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np

from trainer.ckpt import tiers, weights
from trainer.config import FROZEN_KEYS, Config, ConfigError, dump_yaml, to_dict
from trainer.faults.injector import FaultInjector
from trainer.model.model import GPT, abstract_params, mlp_width
from trainer.observe import alerts
from trainer.observe.events import EventLog
from trainer.observe.heartbeat import Heartbeat, node_name
from trainer.observe.spikes import SpikeDetector
from trainer.observe.tensorboard import Writer
from trainer.parallel import distributed
from trainer.parallel import mesh as mesh_lib
from trainer.store import ckpt_files as checkpoint_files
from trainer.store import env_vars, rundir
from trainer.store.event_names import (
    CONFIG_CHANGED,
    DATA_READY,
    ELASTIC_MICROBATCHES,
    RUNBOOK_RETRIES,
    SESSION_START,
    STACK_CHANGED,
)
from trainer.supervise import runbook
from trainer.train import data, optim
from trainer.train import state as state_lib
from trainer.train.replicas import ReplicaCheck


@dataclasses.dataclass(frozen=True)
class Worker:
    """What the loop uses, built once by `setup` and never reassigned."""

    cfg: Config
    run_dir: Path
    primary: bool  # process 0: the only one that writes the run's events, TensorBoard and the summary
    corpus: data.Corpus
    mesh: jax.sharding.Mesh
    spec: state_lib.StateSpec
    ckpt: tiers.Tiers  # the durable checkpoint tier and the optional node-local one
    events: EventLog
    scalars: Writer
    heartbeat: Heartbeat
    faults: FaultInjector
    skips: list[int]  # data batches the runbook skips (runbook.json)
    hyperparams: dict[str, float]  # the runbook's lr_scale, clip_norm, b2 (runbook.json)
    lrs: np.ndarray  # the schedule's rate at each step (optim.lr_table): the train step's input
    n_params: int
    replicas: ReplicaCheck | None  # integrity.replica_check_steps > 0: compares data-parallel copies of the params
    eval_windows: np.ndarray | None  # this process's rows of the fixed eval batches (None: eval off)
    microbatches: int  # train.microbatches, raised when the group shrank (elastic_microbatches)
    init_from: dict | None  # train.init_from's checkpoint (weights.init_source); a resume keeps the checkpoint's
    # Observers of each step's metrics: objects with on_step(step, rec) -> action dict | None.
    monitors: list = dataclasses.field(default_factory=list)
    # When this attempt's start-up reached each boundary of trainer.observe.downtime.MARKS (restoring, ...).
    marks: dict[str, float] = dataclasses.field(default_factory=dict)


def setup_compile_cache(path: str) -> None:
    if not path:
        return
    jax.config.update("jax_compilation_cache_dir", str(Path(path).expanduser()))
    # Cache every executable, however small or quick to build: a restart should never recompile.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    if jax.process_count() > 1 and jax.default_backend() == "cpu":
        distributed.cache_every_processes_executables()


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
                f"{_dig(now, key)!r}; use a new run.dir or restore the old value"
            )
    if saved["data_fingerprint"] != fingerprint:
        raise ConfigError(
            f"cannot resume {cfg.run.dir}: the training data changed (fingerprint "
            f"{saved['data_fingerprint'][:12]} -> {fingerprint[:12]}); point data.path at the original corpus"
        )
    changes = []
    for section, values in now.items():
        old = saved["config"].get(section)
        if old != values and section != "faults":
            changes.append(f"{section}: {old} -> {values}")
    return changes


def check_durable_dir(run_dir: Path, configured: str) -> None:
    """A run's checkpoints stay where it started them: a resume that names another checkpoint.durable_dir would
    start over beside the run's history, so it is refused (one line, nothing written)."""
    if (run_dir / rundir.CONFIG).is_file() and (was := checkpoint_files.saved_durable_dir(run_dir)) != configured:
        raise ConfigError(
            f"checkpoint.durable_dir changed from {was or repr('')} to {configured or repr('')}: this run's "
            f"checkpoints are in {checkpoint_files.durable_dir(run_dir, was)}; set it back, or move them there "
            f"and update {run_dir / rundir.CONFIG}"
        )


def elastic_microbatches(cfg: Config, processes: int) -> int:
    """train.microbatches, times the factor by which the group shrank below launch.processes (the launcher
    shrinks only to a divisor): same global batch, same per-device batch, more slices per step."""
    if processes < cfg.launch.processes and cfg.launch.processes % processes == 0:
        return cfg.train.microbatches * (cfg.launch.processes // processes)
    return cfg.train.microbatches


STACK = ("jax", "jaxlib", "flax", "optax")  # bitwise resume is promised only within one version of each


def stack_changes(saved: dict, cfg: Config) -> list[str]:
    """What differs from the checkpoint's software stack: versions, or XLA's deterministic-ops setting."""
    now, old = versions(), saved.get("versions", {})
    out = [f"{pkg} {old.get(pkg)} -> {now.get(pkg)}" for pkg in STACK if old.get(pkg) != now.get(pkg)]
    was = saved["config"]["run"].get("deterministic", False)
    if was != cfg.run.deterministic:
        out.append(f"run.deterministic {was} -> {cfg.run.deterministic}")
    return out


def validate_shapes(
    cfg: Config, mesh_shape: tuple[int, int, int], processes: int, microbatches: int, corpus: data.Corpus | None
) -> None:
    """Shapes the mesh and batch must divide; `corpus` None: sizing a run without its data (inspect)."""
    data_par, _, tensor = mesh_shape
    if corpus is not None and cfg.model.vocab_size < corpus.vocab_size:
        raise ConfigError(
            f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer's vocabulary "
            f"({corpus.vocab_size}, {corpus.meta['tokenizer']} in {corpus.dir}); set model.vocab_size >= "
            f"{corpus.vocab_size}"
        )
    for key, v in (
        ("model.vocab_size", cfg.model.vocab_size),
        ("model.n_heads", cfg.model.n_heads),
        ("model.d_ff", mlp_width(cfg.model)),
    ):
        if v % tensor:
            raise ConfigError(f"{key} ({v}) must be divisible by mesh.tensor ({tensor})")
    local = (data_par * mesh_shape[1] * tensor) // processes
    if local % tensor:  # each process feeds its own rows: a tensor group (replicas of the rows) must be in one
        raise ConfigError(
            f"mesh.tensor ({tensor}) spans processes ({local} devices per process): a tensor-parallel group must "
            f"sit inside one process (one host); lower mesh.tensor to a divisor of {local}"
        )
    shards = data_par * mesh_shape[1]
    if cfg.data.batch_size % shards or cfg.data.batch_size % processes:
        raise ConfigError(
            f"data.batch_size ({cfg.data.batch_size}) must be divisible by data x fsdp ({shards})"
            f" and by the process count ({processes})"
        )
    if (cfg.data.batch_size // shards) % microbatches:
        raise ConfigError(
            f"data.batch_size / (data x fsdp) = {cfg.data.batch_size // shards} sequences per device"
            f" must be divisible by train.microbatches ({microbatches}"
            f"{', raised for the shrunk group' if microbatches != cfg.train.microbatches else ''})"
        )


def versions() -> dict:
    out = {}
    for pkg in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "numpy"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _load_data(cfg: Config) -> tuple[data.Corpus, np.ndarray | None, float]:
    """The prepared data (a raw path is prepared once per group), this process's eval windows (None: eval
    off) and the seconds it took."""
    t0 = time.perf_counter()
    corpus = data.prepare(cfg.data, process=jax.process_index(), min_tokens=cfg.model.seq_len + 1)
    windows = (
        None
        if not cfg.eval.every_steps
        else data.eval_windows(
            corpus,
            seq_len=cfg.model.seq_len,
            global_batch=cfg.data.batch_size,
            batches=cfg.eval.batches,
            process=jax.process_index(),
            processes=jax.process_count(),
        )
    )
    return corpus, windows, time.perf_counter() - t0


def _announce_changes(cfg: Config, events: EventLog, saved: dict | None, microbatches: int, *, primary: bool) -> None:
    """What this start changes against the plan or the checkpoint: a shrunk group's microbatches, another
    software stack (an event, and one stderr line: bitwise resume no longer holds)."""
    if microbatches != cfg.train.microbatches:
        events.write(
            ELASTIC_MICROBATCHES,
            processes=jax.process_count(),
            planned=cfg.launch.processes,
            microbatches=microbatches,
            detail="the group shrank: same global and per-device batch",
        )
    if saved and (stack := stack_changes(saved, cfg)):
        events.write(
            STACK_CHANGED,
            changes=stack,
            meaning="resumed on another software stack: the run "
            "continues, but bitwise equality with an uninterrupted run is no longer promised",
        )
        if primary:
            print(
                f"warning: resuming on another software stack ({'; '.join(stack)}): not bitwise resumable",
                file=sys.stderr,
            )


def state_spec(cfg: Config, mesh: jax.sharding.Mesh) -> state_lib.StateSpec:
    """The train state's spec for a config on a mesh (the model, its optimizer, the seeded init): what the
    worker trains, and what inspect and the benchmarks compile."""
    model = GPT(cfg.model)
    params = abstract_params(model)  # traced once: the decay mask and the state's shardings both read it
    tx = optim.make_optimizer(cfg.optim, cfg.model, params)
    return state_lib.build(model, tx, mesh, seed=cfg.run.seed, seq_len=cfg.model.seq_len, params=params)


def setup(cfg: Config) -> Worker:
    """Validate everything that can be wrong before the first write to the run dir, then build."""
    run_dir = Path(cfg.run.dir)
    corpus, eval_windows, data_s = _load_data(cfg)
    shape = mesh_lib.mesh_shape(cfg.mesh, jax.device_count())
    microbatches = elastic_microbatches(cfg, jax.process_count())
    validate_shapes(cfg, shape, jax.process_count(), microbatches, corpus)
    check_durable_dir(run_dir, cfg.checkpoint.durable_dir)
    saved = tiers.saved_meta(run_dir, cfg.checkpoint)  # read once: the restore of that step uses it too
    changes = check_resume(saved.record, cfg, corpus.fingerprint) if saved else []
    init_from = saved.init_from if saved else weights.init_source(cfg)  # a resume never re-applies it

    primary = jax.process_index() == 0
    if primary and mesh_lib.kv_replicated(cfg.model, shape[2]):
        print(
            f"note: model.n_kv_heads ({cfg.model.n_kv_heads}) does not divide mesh.tensor ({shape[2]}): the K/V "
            "projections are replicated over the tensor axis",
            file=sys.stderr,
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    setup_compile_cache(cfg.run.compile_cache)
    events = EventLog(run_dir / rundir.EVENTS, enabled=primary)
    rb = runbook.RunbookState.load(run_dir, cfg.optim)
    _record_start(cfg, events, rb, corpus, data_s, changes=changes, primary=primary)
    _announce_changes(cfg, events, saved and saved.record, microbatches, primary=primary)
    mesh = mesh_lib.make_mesh(cfg.mesh)
    spec = state_spec(cfg, mesh)
    scalars = _scalars(cfg, primary=primary, fresh=not saved)
    node_local = None
    if cfg.checkpoint.local_dir:  # what the `node` fault deletes with the node
        node_local = checkpoint_files.local_root(cfg.checkpoint.local_dir, run_dir, node_name(jax.process_index()))
    me = jax.process_index()
    faults = FaultInjector(cfg.faults, run_dir, process=me, node=node_name(me), node_local=node_local)
    faults.at_startup()
    w = Worker(
        cfg=cfg,
        run_dir=run_dir,
        primary=primary,
        corpus=corpus,
        mesh=mesh,
        spec=spec,
        ckpt=_tiers(cfg, events, rb, faults, saved),
        events=events,
        scalars=scalars,
        heartbeat=Heartbeat(run_dir, jax.process_index(), data=corpus.fingerprint),
        faults=faults,
        skips=rb.skips,
        hyperparams=rb.hyperparams(),
        lrs=optim.lr_table(cfg.optim, cfg.train.steps),
        n_params=state_lib.param_count(spec.abstract),
        replicas=ReplicaCheck(mesh, spec.abstract["params"]) if cfg.integrity.replica_check_steps else None,
        eval_windows=eval_windows,
        microbatches=microbatches,
        init_from=init_from,
    )
    _add_monitors(w, rb)
    return w


def _tiers(
    cfg: Config, events: EventLog, rb: runbook.RunbookState, faults: FaultInjector, saved: checkpoint_files.Meta | None
) -> tiers.Tiers:
    """The checkpoint tiers, keeping what the runbook pins, knowing its rewinds, reusing the metadata read at
    start-up (`saved`) in the restore."""
    pins = lambda steps: runbook.retention_pins(  # noqa: E731
        steps, window=cfg.runbook.window if cfg.runbook.enabled else None, pinned=rb.pinned
    )
    return tiers.Tiers(
        Path(cfg.run.dir),
        cfg.checkpoint,
        log=events.write,
        pinned=pins,
        rewinds=[h["to"] for h in rb.history if h["action"] in RUNBOOK_RETRIES],
        commit_delay=faults.commit_delay if faults.slow_saves() else None,
        saved=saved,
    )


def _record_start(
    cfg: Config, events: EventLog, rb: runbook.RunbookState, corpus: data.Corpus, data_s: float, *, changes, primary
) -> None:
    """The run dir's first writes of this start: the session (unsupervised), the config as trained, what
    changed since the checkpoint, and the data."""
    run_dir = Path(cfg.run.dir)
    if env_vars.ATTEMPT not in os.environ:  # unsupervised: this process is the session (the goodput ledger's unit)
        events.write(SESSION_START, pid=os.getpid())
    if primary:  # as trained: with the runbook's softened LR, clip and b2, if it softened them
        rundir.atomic_write(run_dir / rundir.CONFIG, dump_yaml(runbook.softened_config(cfg, rb)))
    for c in changes:
        events.write(CONFIG_CHANGED, change=c)
    events.write(
        DATA_READY,
        seconds=data_s,
        dir=str(corpus.dir),
        source=corpus.source,
        tokenizer=corpus.meta["tokenizer"],
        vocab_size=corpus.vocab_size,
        n_tokens=corpus.n_tokens,
        n_val_tokens=corpus.n_val_tokens,
        fingerprint=corpus.fingerprint,
        prepared_now=corpus.fresh,
    )


def _scalars(cfg: Config, *, primary: bool, fresh: bool) -> Writer:
    """The TensorBoard writer: process 0's is the run's, a fresh run's first records its config; every other
    process writes its own host's health and alerts (the run's metrics are the same on every process)."""
    logdir = Path(cfg.run.dir) / rundir.TENSORBOARD
    if not primary:
        me = jax.process_index()
        return Writer(
            logdir / rundir.TB_HOSTS / f"p{me}-{node_name(me)}",
            enabled=cfg.log.tensorboard and cfg.log.health,
            only=("health/", "alerts/"),
        )
    scalars = Writer(logdir, enabled=cfg.log.tensorboard)
    if fresh:
        scalars.text("config", "```\n" + dump_yaml(cfg) + "\n```")
        scalars.hparams(
            to_dict(cfg), metric_tags=("loss/train", "loss/eval", "throughput/tokens_per_s", "throughput/mfu")
        )
    return scalars


def _add_monitors(w: Worker, rb: runbook.RunbookState) -> None:
    """Dashboard: grad-norm trend, throughput drop, hardware health (ECC rising -> checkpoint now), markers;
    and the spike detector when the runbook is on."""
    cfg = w.cfg
    me = jax.process_index()
    host_events = EventLog(w.run_dir / rundir.EVENTS, tags={"process": me, "node": node_name(me)})
    w.monitors.extend(
        alerts.build(
            cfg,
            run_dir=w.run_dir,
            events=w.events,
            host_events=host_events,
            scalars=w.scalars,
            faults=w.faults,
            primary=w.primary,
        )
    )
    if cfg.runbook.enabled:
        w.monitors.append(
            SpikeDetector(
                cfg.runbook,
                log=w.events.write,
                batch_of=lambda s: data.batch_index(s - 1, rb.skips),
                stop_step=cfg.train.stop_at_step or cfg.train.steps,
                events_path=w.run_dir / rundir.EVENTS,
            )
        )
