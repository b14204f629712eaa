"""Typed run configuration: dataclasses declared once, YAML files as diffs, `--set` overrides, validation.

- training.py: the sections the worker trains with (run, mesh, model, data, eval, optim, train, checkpoint, log,
  integrity);
- supervision.py: those that keep the run alive (supervisor, launch, alerts, straggler, runbook, faults), and
  the vocabularies a fault names (its kinds, the heartbeat's phases as Phase with each one's timeout, the ways
  to corrupt a checkpoint);
- here: the tree of sections, how it is read, and the rules across sections.

Each section's rules live with it: ranges and choices on its fields' types (trainer.yamltree's Positive, Range,
OneOf), the rules between its fields in its check(). Nothing here imports jax (the supervisor reads configs too,
and the fake-CPU-device count has to be decided before jax initialises) or the project beyond trainer.yamltree.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import yaml

from trainer.config.supervision import (
    CORRUPT_HOW,
    FAULT_KINDS,
    FAULT_PHASES,
    AlertsConfig,
    Fault,
    LaunchConfig,
    Phase,
    RunbookConfig,
    StragglerConfig,
    SupervisorConfig,
)
from trainer.config.training import (
    ARCH_DEFAULTS,
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    IntegrityConfig,
    LogConfig,
    MeshConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
)
from trainer.yamltree import ConfigError, Section, build, check_section, read_yaml, set_dotted

__all__ = [
    "ARCH_DEFAULTS",
    "CORRUPT_HOW",
    "FAULT_KINDS",
    "FAULT_PHASES",
    "FROZEN_KEYS",
    "AlertsConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "Fault",
    "IntegrityConfig",
    "LaunchConfig",
    "LogConfig",
    "MeshConfig",
    "ModelConfig",
    "OptimConfig",
    "Phase",
    "RunConfig",
    "RunbookConfig",
    "StragglerConfig",
    "SupervisorConfig",
    "TrainConfig",
    "dump_yaml",
    "from_tree",
    "load_config",
    "to_dict",
]

FROZEN_KEYS = ("model", "data.batch_size", "data.shuffle", "run.seed")  # changed, a checkpoint means nothing: no resume


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    runbook: RunbookConfig = field(default_factory=RunbookConfig)
    alerts: AlertsConfig = field(default_factory=AlertsConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    integrity: IntegrityConfig = field(default_factory=IntegrityConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    faults: list[Fault] = field(default_factory=list)


def load_config(path: str | None, overrides: list[str] = ()) -> Config:
    """Defaults <- YAML diff <- dotted overrides, then validation."""
    tree = read_yaml(path) if path else {}
    for o in overrides:
        set_dotted(tree, o)
    return from_tree(tree)


def from_tree(tree: dict) -> Config:
    """A YAML tree (sections of keys; what it leaves out takes the defaults) as a validated Config."""
    cfg = build(Config, _with_arch(tree), "")
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Each section's rules, then the one across sections (the process a fault fires on exists)."""
    for where, section in _sections(cfg):
        check_section(section, where)
    processes = cfg.launch.processes
    for i, fault in enumerate(cfg.faults):
        if not 0 <= fault.process < processes:
            raise ConfigError(f"faults[{i}].process must be in [0, launch.processes={processes}), got {fault.process}")


def _sections(cfg: Config) -> list[tuple[str, Section]]:
    """Every section with its key, in the tree's order: faults[i] for each fault."""
    out = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        out += [(f"{f.name}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, list) else [(f.name, value)]
    return out


def _with_arch(tree: dict) -> dict:
    """The tree with model.arch's parts filled in where the model section leaves them unset."""
    model = tree.get("model")
    arch = model.get("arch", "gpt2") if isinstance(model, dict) else "gpt2"
    if arch not in ARCH_DEFAULTS:
        raise ConfigError(f"model.arch must be one of {', '.join(ARCH_DEFAULTS)}, got {arch!r}")
    if not ARCH_DEFAULTS[arch]:
        return tree
    return dict(tree, model={**ARCH_DEFAULTS[arch], **model})


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
