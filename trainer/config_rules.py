"""The rules a config must satisfy, checked once after it is built (trainer.config.from_tree): ranges, the
choices a key may take, and the sections that must agree with each other. Each broken rule is one
ConfigError naming the key and what it must be. No jax, and no runtime import of trainer.config (which
imports this module): the sections arrive as arguments.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.yamltree import ConfigError

if TYPE_CHECKING:
    from trainer.config import Config, Fault, LaunchConfig, RunbookConfig, StragglerConfig

REMAT = ("none", "full", "save_dots", "save_attention")  # model.remat's policies (trainer.model.model)

MODEL_CHOICES = {
    "position": ("learned", "rope"),
    "norm": ("layernorm", "rmsnorm"),
    "mlp": ("gelu", "swiglu"),
    "compute_dtype": ("float32", "bfloat16"),
    "attention": ("auto", "xla", "xla_remat", "cudnn"),
}

# faults[].kind and faults[].phase (where hang and slow fire); trainer.faults.injector fires them
FAULT_KINDS = tuple(
    "crash hang crash_mid_save slow hog slow_save signal ecc nan spike bitflip startup node corrupt disk_full".split()
)
CORRUPT_HOW = ("flip", "truncate", "torn")  # faults[].how for corrupt (trainer.faults.corrupt)
FAULT_PHASES = ("step", "startup", "restore", "compile", "checkpoint", "eval")


def _positive(cfg: Config, *keys: str, allow_zero: bool = False) -> None:
    for key in keys:
        section, name = key.split(".")
        v = getattr(getattr(cfg, section), name)
        if v < 0 or (v == 0 and not allow_zero):
            need = ">= 0" if allow_zero else "> 0"
            raise ConfigError(f"{key} must be {need}, got {v}")


# Keys that must be > 0, and keys that must be >= 0 (0 means off or none); validate() checks both.
_POSITIVE = (
    "model.vocab_size model.seq_len model.d_model model.n_layers checkpoint.mtbf_hours model.n_heads "
    "model.rope_theta model.norm_eps data.batch_size train.steps train.microbatches optim.lr optim.clip_norm "
    "log.every_steps data.read_threads data.default_corpus_mb data.prepare_workers eval.batches "
    "checkpoint.keep_latest mesh.fsdp mesh.tensor supervisor.crash_loop_restarts supervisor.step_timeout_s "
    "supervisor.eval_timeout_s supervisor.poll_s log.health_every_s alerts.grad_window alerts.grad_rise "
    "alerts.throughput_window alerts.throughput_steps alerts.ecc_rise alerts.overdue_fraction"
).split()

_NON_NEGATIVE = (
    "model.d_ff model.n_kv_heads model.loss_chunk train.z_loss optim.warmup_steps train.stop_at_step "
    "checkpoint.every_steps checkpoint.keep_every checkpoint.auto_devices mesh.cpu_devices "
    "checkpoint.local_every_steps checkpoint.local_every_minutes integrity.replica_check_steps log.peak_flops "
    "data.prefetch supervisor.max_restarts eval.every_steps launch.suspect_retry_minutes launch.cpus_per_process "
    "supervisor.storage_wait_minutes"
).split()


def validate(cfg: Config) -> None:
    _validate_ranges(cfg)
    _validate_interval(cfg)
    _validate_model_and_run(cfg)
    _validate_faults(cfg.faults, cfg.launch.processes)
    _validate_launch(cfg.launch)
    _validate_runbook(cfg.runbook)
    _validate_straggler(cfg.straggler)


def _validate_ranges(cfg: Config) -> None:
    """Keys that must be positive (or non-negative), and the alert thresholds' intervals."""
    _positive(cfg, *_POSITIVE)
    _positive(cfg, *_NON_NEGATIVE, allow_zero=True)
    if not 0.0 < cfg.alerts.throughput_drop < 1.0:
        raise ConfigError(f"alerts.throughput_drop must be in (0, 1), got {cfg.alerts.throughput_drop}")
    if not 0.0 < cfg.alerts.overdue_fraction < 1.0:
        raise ConfigError(f"alerts.overdue_fraction must be in (0, 1), got {cfg.alerts.overdue_fraction}")
    if cfg.alerts.grad_rise <= 1.0:
        raise ConfigError(f"alerts.grad_rise must be > 1 (a growth factor), got {cfg.alerts.grad_rise}")
    if cfg.mesh.data == 0 or cfg.mesh.data < -1:
        raise ConfigError(f"mesh.data must be > 0 or -1 (fill), got {cfg.mesh.data}")


def _validate_model_and_run(cfg: Config) -> None:
    m = cfg.model
    if m.d_model % m.n_heads:
        raise ConfigError(f"model.d_model ({m.d_model}) must be divisible by model.n_heads ({m.n_heads})")
    if m.n_heads % (m.n_kv_heads or m.n_heads):
        raise ConfigError(f"model.n_heads ({m.n_heads}) must be a multiple of model.n_kv_heads ({m.n_kv_heads})")
    for key, choices in MODEL_CHOICES.items():
        if getattr(m, key) not in choices:
            say = f"{', '.join(choices[:-1])} or {choices[-1]}"
            raise ConfigError(f"model.{key} must be {say}, got {getattr(m, key)!r}")
    if m.position == "rope" and (m.d_model // m.n_heads) % 2:
        raise ConfigError(f"model.position=rope needs an even head dim (d_model / n_heads = {m.d_model // m.n_heads})")
    if m.loss_chunk and m.seq_len % m.loss_chunk:
        raise ConfigError(f"model.loss_chunk ({m.loss_chunk}) must divide model.seq_len ({m.seq_len}), or be 0 (auto)")
    if (remat := cfg.model.remat) not in REMAT:  # was a bool: say which policy the old value meant
        was = {"True": "; true is now full", "False": "; false is now none"}.get(remat, "")
        raise ConfigError(f"model.remat must be one of {', '.join(REMAT)}, got {remat!r}{was}")
    if not 0.0 <= cfg.model.dropout < 1.0:
        raise ConfigError(f"model.dropout must be in [0, 1), got {cfg.model.dropout}")
    if cfg.train.stop_at_step > cfg.train.steps:
        raise ConfigError(f"train.stop_at_step ({cfg.train.stop_at_step}) is past train.steps ({cfg.train.steps})")
    if not cfg.run.dir:
        raise ConfigError("run.dir must be set (e.g. --set run.dir=runs/mine)")
    if not 0.0 <= (fraction := cfg.run.gpu_mem_fraction) <= 1.0:
        raise ConfigError(f"run.gpu_mem_fraction must be in (0, 1] or 0 (jax's default), got {fraction}")


def _validate_faults(faults: list[Fault], processes: int) -> None:
    for i, f in enumerate(faults):
        if not 0 <= f.process < processes:
            raise ConfigError(f"faults[{i}].process must be in [0, launch.processes={processes}), got {f.process}")
        if f.kind not in FAULT_KINDS:
            raise ConfigError(f"faults[{i}].kind must be one of {', '.join(FAULT_KINDS)}, got {f.kind!r}")
        if f.step < 0:
            raise ConfigError(f"faults[{i}].step must be >= 0, got {f.step}")
        if f.node and f.kind not in ("slow", "hog"):
            raise ConfigError(f"faults[{i}].node is for slow and hog (a slow host), not {f.kind}: use process")
        if (f.kind == "corrupt") != bool(f.how) or (f.how and f.how not in CORRUPT_HOW):
            raise ConfigError(f"faults[{i}].how is for corrupt only, one of {', '.join(CORRUPT_HOW)}, got {f.how!r}")
        if f.phase not in FAULT_PHASES or (f.phase != "step" and f.kind not in ("hang", "slow")):
            raise ConfigError(
                f"faults[{i}].phase must be one of {', '.join(FAULT_PHASES)} (hang and slow only), "
                f"got {f.phase!r} for {f.kind}"
            )


def _validate_runbook(rc: RunbookConfig) -> None:
    for key in ("window", "min_history", "loss_sigma", "grad_sigma", "grad_sustain", "onset_sigma", "max_actions"):
        if getattr(rc, key) <= 0:
            raise ConfigError(f"runbook.{key} must be > 0, got {getattr(rc, key)}")
    for key in ("warmup_steps", "probe_steps", "recur_distance", "loss_min_rise", "grad_min_rise"):
        if getattr(rc, key) < 0:
            raise ConfigError(f"runbook.{key} must be >= 0, got {getattr(rc, key)}")
    if rc.min_history > rc.window:
        raise ConfigError(f"runbook.min_history ({rc.min_history}) must be <= runbook.window ({rc.window})")
    if rc.onset_sigma > min(rc.loss_sigma, rc.grad_sigma):
        raise ConfigError(f"runbook.onset_sigma ({rc.onset_sigma}) must be <= loss_sigma and grad_sigma")
    for key in ("lr_factor", "clip_factor"):
        if not 0.0 < getattr(rc, key) <= 1.0:
            raise ConfigError(f"runbook.{key} must be in (0, 1], got {getattr(rc, key)}")
    if not (rc.b2 == 0.0 or 0.0 < rc.b2 < 1.0):
        raise ConfigError(f"runbook.b2 must be 0 (unchanged) or in (0, 1), got {rc.b2}")


def _validate_launch(lc: LaunchConfig) -> None:
    if lc.mode not in ("local", "slurm"):
        raise ConfigError(f"launch.mode must be local or slurm, got {lc.mode!r}")
    if lc.processes < 1 or lc.processes_per_node < 1 or lc.init_timeout_s < 1:
        raise ConfigError(
            f"launch.processes ({lc.processes}), launch.processes_per_node ({lc.processes_per_node})"
            f" and launch.init_timeout_s ({lc.init_timeout_s}) must be >= 1"
        )
    if lc.processes % lc.processes_per_node:
        raise ConfigError(
            f"launch.processes ({lc.processes}) must be a multiple of launch.processes_per_node"
            f" ({lc.processes_per_node})"
        )
    if not 0 <= lc.min_processes <= lc.processes:
        raise ConfigError(
            f"launch.min_processes must be in [0, launch.processes={lc.processes}], got {lc.min_processes}"
        )
    if not (lc.coordinator_port == 0 or 1024 <= lc.coordinator_port <= 64000):
        raise ConfigError(
            f"launch.coordinator_port must be 0 (pick one) or in [1024, 64000], got {lc.coordinator_port}"
        )


def _validate_interval(cfg: Config) -> None:
    m = cfg.checkpoint.every_minutes
    if isinstance(m, str) and m != "auto":
        try:
            m = float(m)
        except ValueError:
            raise ConfigError(f"checkpoint.every_minutes must be a number of minutes or 'auto', got {m!r}") from None
    if not isinstance(m, str) and (isinstance(m, bool) or m < 0):
        raise ConfigError(f"checkpoint.every_minutes must be >= 0 or 'auto', got {m!r}")
    cfg.checkpoint.every_minutes = m
    if bool(cfg.checkpoint.local_dir) != bool(cfg.checkpoint.local_every_steps or cfg.checkpoint.local_every_minutes):
        raise ConfigError("set checkpoint.local_dir and local_every_steps/_minutes together, or neither")


def _validate_straggler(sc: StragglerConfig) -> None:
    if sc.factor <= 1.0:
        raise ConfigError(f"straggler.factor must be > 1 (a slowdown factor), got {sc.factor}")
    for key in ("window_steps", "windows"):
        if getattr(sc, key) < 1:
            raise ConfigError(f"straggler.{key} must be >= 1, got {getattr(sc, key)}")
    if sc.grace_steps < 0 or sc.mad_k < 0:
        raise ConfigError(f"straggler.grace_steps ({sc.grace_steps}) and straggler.mad_k ({sc.mad_k}) must be >= 0")
    if sc.action not in ("alert", "drain"):
        raise ConfigError(f"straggler.action must be alert or drain, got {sc.action!r}")
