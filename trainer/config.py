"""Typed run configuration: dataclasses declared once, YAML files as diffs, `--set` overrides.

This module must not import jax: the supervisor reads configs too, and the fake-CPU-device count
has to be decided before jax initialises.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A user mistake in the config or its inputs; the CLI prints it as one line and exits 2."""


@dataclass
class RunConfig:
    dir: str = "runs/default"  # run directory: checkpoints, events, TensorBoard, summary
    seed: int = 0  # seeds params init, dropout and the data order
    supervise: bool = True  # False runs the worker in this process (debugging)
    compile_cache: str = "~/.cache/trainer/jax"  # JAX persistent compilation cache ("" = off)


@dataclass
class MeshConfig:
    data: int = -1  # -1 = whatever the other axes leave of the device count
    fsdp: int = 1
    tensor: int = 1
    cpu_devices: int = 0  # >0: force this many fake CPU devices per process (test mode)


@dataclass
class ModelConfig:
    vocab_size: int = 384  # >= tokenizer vocab; a multiple of the tensor axis
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 0  # 0 = 4 * d_model
    dropout: float = 0.0
    compute_dtype: str = "float32"  # float32 | bfloat16 (params stay fp32)
    attention: str = "auto"  # auto | xla | cudnn (auto = cudnn on GPU with bf16)
    remat: bool = False  # rematerialise each block in the backward pass
    tie_embeddings: bool = True


@dataclass
class DataConfig:
    path: str = ""  # text file or directory; "" = embedded default corpus (Python stdlib source)
    cache_dir: str = "~/.cache/trainer/data"  # where prepared token files live
    batch_size: int = 16  # global batch, in sequences
    shuffle: bool = True  # False = sequential window order (debugging)
    read_threads: int = 2
    prefetch: int = 4
    default_corpus_mb: float = 4.0  # size cap of the embedded default corpus
    audit: bool = False  # record the global sample ids of every step (data audit)


@dataclass
class OptimConfig:
    lr: float = 1e-3  # peak learning rate
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at train.steps
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # applied to matrices only (not norms, biases)
    clip_norm: float = 1.0  # global-norm gradient clipping


@dataclass
class TrainConfig:
    steps: int = 200  # total steps: fixes the LR schedule
    stop_at_step: int = 0  # >0: save and exit cleanly at this step without touching the schedule


@dataclass
class CheckpointConfig:
    every_steps: int = 50  # 0 = no step-based saves
    every_minutes: float = 0.0  # 0 = no time-based saves
    keep_latest: int = 3
    keep_every: int = 0  # also keep every Nth step forever (0 = off)
    async_save: bool = True


@dataclass
class LogConfig:
    every_steps: int = 10
    tensorboard: bool = True
    progress: bool = True  # console progress line
    peak_flops: float = 0.0  # per-device peak FLOP/s for MFU; 0 = look up the GPU table


@dataclass
class Fault:
    kind: str  # crash | hang | crash_mid_save | slow | signal
    step: int
    seconds: float = 0.0  # slow: extra seconds per step
    count: int = 1  # slow: how many steps
    signal: str = "SIGKILL"  # signal: which one the worker sends itself


@dataclass
class SupervisorConfig:
    max_restarts: int = 20
    backoff_s: float = 1.0  # first restart delay; doubles up to backoff_max_s
    backoff_max_s: float = 60.0
    crash_loop_restarts: int = 3  # this many failures with no step of progress = crash loop
    startup_timeout_s: float = 600.0  # heartbeat silence allowed while starting/compiling
    restore_timeout_s: float = 600.0
    step_timeout_s: float = 120.0
    checkpoint_timeout_s: float = 600.0
    poll_s: float = 0.5


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    faults: list[Fault] = field(default_factory=list)


def _coerce(value: Any, typ: Any, key: str) -> Any:
    """Convert a YAML/CLI value to the declared type, or raise ConfigError naming the key."""
    origin = typing.get_origin(typ)
    if origin is list:
        (item_t,) = typing.get_args(typ)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, item_t, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        return value
    if dataclasses.is_dataclass(typ):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return _build(typ, value, key)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if typ is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    raise AssertionError(f"unsupported config type {typ} at {key}")


def _build(cls: type, values: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in values:
        if k not in names:
            where = f"{prefix}.{k}" if prefix else k
            raise ConfigError(f"unknown config key '{where}' (known: {', '.join(sorted(names))})")
    kwargs = {k: _coerce(v, hints[k], f"{prefix}.{k}" if prefix else k) for k, v in values.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{prefix}: {e}") from None


def _set_dotted(tree: dict, dotted: str) -> None:
    if "=" not in dotted:
        raise ConfigError(f"--set {dotted!r}: expected dotted.key=value")
    key, raw = dotted.split("=", 1)
    value = yaml.safe_load(raw) if raw != "" else ""
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: '{p}' is not a section")
    node[parts[-1]] = value


def load_config(path: str | None, overrides: list[str] = ()) -> Config:
    """Defaults <- YAML diff <- dotted overrides, then validation."""
    tree: dict = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {path} (pass an existing YAML, e.g. configs/tiny.yaml)")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            line = getattr(getattr(e, "problem_mark", None), "line", -1) + 1
            raise ConfigError(f"{path}: not valid YAML (line {line})") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
    for o in overrides:
        _set_dotted(tree, o)
    cfg = _build(Config, tree, "")
    validate(cfg)
    return cfg


def _positive(cfg: Config, *keys: str, allow_zero: bool = False) -> None:
    for key in keys:
        section, name = key.split(".")
        v = getattr(getattr(cfg, section), name)
        if v < 0 or (v == 0 and not allow_zero):
            need = ">= 0" if allow_zero else "> 0"
            raise ConfigError(f"{key} must be {need}, got {v}")


def validate(cfg: Config) -> None:
    _positive(cfg, "model.vocab_size", "model.seq_len", "model.d_model", "model.n_layers",
              "model.n_heads", "data.batch_size", "train.steps", "optim.lr", "optim.clip_norm",
              "log.every_steps", "data.read_threads", "data.default_corpus_mb")
    _positive(cfg, "model.d_ff", "optim.warmup_steps", "train.stop_at_step", "checkpoint.every_steps",
              "checkpoint.every_minutes", "checkpoint.keep_every", "mesh.cpu_devices",
              "log.peak_flops", "data.prefetch", "supervisor.max_restarts", allow_zero=True)
    _positive(cfg, "checkpoint.keep_latest", "mesh.fsdp", "mesh.tensor",
              "supervisor.crash_loop_restarts", "supervisor.step_timeout_s", "supervisor.poll_s")
    if cfg.mesh.data == 0 or cfg.mesh.data < -1:
        raise ConfigError(f"mesh.data must be > 0 or -1 (fill), got {cfg.mesh.data}")
    if cfg.model.d_model % cfg.model.n_heads:
        raise ConfigError(
            f"model.d_model ({cfg.model.d_model}) must be divisible by model.n_heads ({cfg.model.n_heads})")
    if cfg.model.compute_dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"model.compute_dtype must be float32 or bfloat16, got {cfg.model.compute_dtype!r}")
    if cfg.model.attention not in ("auto", "xla", "cudnn"):
        raise ConfigError(f"model.attention must be auto, xla or cudnn, got {cfg.model.attention!r}")
    if not 0.0 <= cfg.model.dropout < 1.0:
        raise ConfigError(f"model.dropout must be in [0, 1), got {cfg.model.dropout}")
    if cfg.train.stop_at_step > cfg.train.steps:
        raise ConfigError(f"train.stop_at_step ({cfg.train.stop_at_step}) is past train.steps ({cfg.train.steps})")
    if not cfg.run.dir:
        raise ConfigError("run.dir must be set (e.g. --set run.dir=runs/mine)")
    from trainer.faults import KINDS  # local: faults imports config

    for i, f in enumerate(cfg.faults):
        if f.kind not in KINDS:
            raise ConfigError(f"faults[{i}].kind must be one of {', '.join(KINDS)}, got {f.kind!r}")
        if f.step < 0:
            raise ConfigError(f"faults[{i}].step must be >= 0, got {f.step}")


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
