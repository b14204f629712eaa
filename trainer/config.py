"""Typed run configuration: dataclasses declared once, YAML files as diffs, `--set` overrides.

This module must not import jax: the supervisor reads configs too, and the fake-CPU-device count
has to be decided before jax initialises.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import yaml

from trainer.config_rules import validate
from trainer.yamltree import ConfigError, build, read_yaml, set_dotted

FROZEN_KEYS = ("model", "data.batch_size", "data.shuffle", "run.seed")  # changed, a checkpoint means nothing: no resume


@dataclass
class RunConfig:
    dir: str = "runs/default"  # run directory: checkpoints, events, TensorBoard, summary
    seed: int = 0  # seeds params init, dropout and the data order
    supervise: bool = True  # False runs the worker in this process (debugging)
    compile_cache: str = "~/.cache/trainer/jax"  # JAX persistent compilation cache ("" = off)
    deterministic: bool = False  # GPU: XLA's deterministic ops (bitwise resume on GPU; slower scatters)
    # The GPU settings below and run.deterministic are set in one place, trainer.xla_env (the reasons beside them)
    xla_latency_hiding: bool = False  # GPU: XLA's latency-hiding scheduler (overlaps collectives with compute)
    gpu_mem_fraction: float = 0.0  # GPU: share of memory jax's allocator takes (0 = jax's default, 0.75)


@dataclass
class MeshConfig:
    data: int = -1  # -1 = whatever the other axes leave of the device count
    fsdp: int = 1
    tensor: int = 1
    cpu_devices: int = 0  # >0: force this many fake CPU devices per process (test mode)


# model.arch -> the parts that family implies, for each model key its YAML leaves unset (trainer.model.model).
ARCH_DEFAULTS = {  # gpt2: the ModelConfig defaults below are GPT-2's
    "gpt2": {},
    "llama": dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False),
}


@dataclass
class ModelConfig:
    arch: str = "gpt2"  # gpt2 | llama: the family whose parts the keys below default to (ARCH_DEFAULTS)
    vocab_size: int = 384  # >= tokenizer vocab; a multiple of the tensor axis
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 0  # K/V heads (grouped-query attention; 1 = multi-query); 0 = n_heads
    d_ff: int = 0  # MLP width; 0 = 4 * d_model (gelu), 8/3 * d_model rounded up to 64 (swiglu)
    position: str = "learned"  # learned (GPT-2's wpe table) | rope (rotary, Llama's)
    rope_theta: float = 10000.0  # rotary base (Llama 3: 500000)
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_eps: float = 1e-5
    mlp: str = "gelu"  # gelu (tanh-GELU, GPT-2) | swiglu (gated, three matrices, Llama)
    qk_norm: bool = False  # RMSNorm of each head's q and k before attention (OLMo 2, Qwen 3)
    dropout: float = 0.0
    compute_dtype: str = "float32"  # float32 | bfloat16 (params stay fp32)
    attention: str = "auto"  # auto | xla | xla_remat | cudnn (auto = cudnn on GPU with bf16, else xla)
    remat: str = "none"  # what each block keeps for the backward pass: none | full | save_dots | save_attention
    scan: bool = True  # scan over layers (compile time flat in depth); false unrolls them
    tie_embeddings: bool = True
    bias: bool = True  # biases in the projections and LayerNorms (GPT-2); false drops them all (nanodo, OLMo)
    loss_chunk: int = 0  # LM head + loss over slices of this many positions (core.loss); 0 = auto (<= 1 GiB logits)


@dataclass
class DataConfig:
    path: str = ""  # prepared DIR, or raw text (file, directory, .jsonl, .parquet); "" = embedded stdlib corpus
    cache_dir: str = "~/.cache/trainer/data"  # where raw text paths are prepared once (content-keyed)
    tokenizer: str = "bytes"  # raw text only: bytes | bpe:N | path to a tokenizer.json | tiktoken:NAME
    text_field: str = "text"  # raw text only: the field of .jsonl records / column of .parquet files
    val_fraction: float = 0.02  # raw text only: share of whole documents held out for eval (fixed rule)
    prepare_workers: int = 1  # raw text only: tokenizer processes when preparing (output does not depend on it)
    batch_size: int = 16  # global batch, in sequences
    shuffle: bool = True  # False = sequential window order (debugging)
    read_threads: int = 2
    prefetch: int = 4
    default_corpus_mb: float = 4.0  # size cap of the embedded default corpus
    audit: bool = False  # record the global sample ids of every step (data audit)


@dataclass
class EvalConfig:
    every_steps: int = 0  # held-out loss every N steps (0 = off); never changes training
    batches: int = 8  # global batches of fixed validation windows per eval


@dataclass
class OptimConfig:
    lr: float = 1e-3  # peak learning rate
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at train.steps
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # on the matrices that multiply activations (optim.DECAY_AXIS): not norms, biases, wpe
    clip_norm: float = 1.0  # global-norm gradient clipping


@dataclass
class TrainConfig:
    steps: int = 200  # total steps: fixes the LR schedule
    stop_at_step: int = 0  # >0: save and exit cleanly at this step without touching the schedule
    microbatches: int = 1  # split each global batch into this many slices, gradients accumulated (memory)
    init_from: str = ""  # run dir, RUN/checkpoints/N or a local Hugging Face model dir: its params start a fresh run
    z_loss: float = 0.0  # weight of mean(logsumexp(logits)^2) added to the loss (PaLM's 1e-4); 0 = off


@dataclass
class CheckpointConfig:
    every_steps: int = 50  # 0 = no step-based saves
    every_minutes: float | str = 0.0  # 0 = no time-based saves; "auto" = derive from stall and failure rate
    mtbf_hours: float = 50000.0  # per-device MTBF assumed by "auto"
    auto_devices: int = 0  # cluster size "auto" optimises for (0 = this run's device count)
    keep_latest: int = 3
    keep_every: int = 0  # also keep every Nth step forever (0 = off)
    async_save: bool = True
    verify: bool = True  # content manifests (sha256 per file) written after each save and checked before a restore
    local_dir: str = ""  # node-local directory (RAM disk, local NVMe) for the fast tier; "" = no local tier
    local_every_steps: int = 0  # local-tier saves every N steps (0 = none by steps)
    local_every_minutes: float = 0.0  # local-tier saves every M minutes (0 = none by time); keep_latest applies too


@dataclass
class LogConfig:
    every_steps: int = 10
    tensorboard: bool = True
    progress: bool = True  # console progress line
    peak_flops: float = 0.0  # per-device peak FLOP/s for MFU; 0 = look up the GPU table
    health: bool = True  # hardware-health collector and run alerts (off only to measure their cost)
    health_every_s: float = 5.0  # seconds between hardware-health samples (background thread)
    report: bool = True  # write RUN_DIR/report/ (PNG plots + report.md) when a run ends


@dataclass
class IntegrityConfig:
    replica_check_steps: int = 0  # compare data-parallel copies of the params every N steps and before saves; 0 = off


@dataclass
class Fault:
    kind: str  # one of FAULT_KINDS (crash, hang, slow, node, ...): what fires; trainer.faults.injector says how
    step: int  # startup: ignored (it fires while the worker starts, before any step)
    # slow: extra seconds per step; hog: its CPU burst per step (0: all the time); slow_save: extra seconds to
    # commit the durable save
    seconds: float = 0.0
    step_multiple: float = 0.0  # slow: sleep this many times the step time measured before it (not `seconds`)
    phase: str = "step"  # hang, slow: the phase they fire in: step | startup | restore | compile | checkpoint | eval
    count: int = 1  # slow, hog: how many steps; ecc: simulated ECC errors added per step from `step` on
    signal: str = "SIGKILL"  # signal: which one the worker sends itself
    scale: float = 1000.0  # spike: multiply the LR by this for the one update at `step`
    repeat: bool = False  # fire on every attempt (a deterministic bug), not just once
    process: int = 0  # the process it fires on (node: that process's whole node is lost; supervise/lose_node.py)
    node: str = ""  # slow, hog: fire on whichever process runs on this node, on every attempt (a slow host)
    how: str = ""  # corrupt: flip | truncate | torn, what happens to the newest durable checkpoint before a crash


@dataclass
class SupervisorConfig:
    max_restarts: int = 20
    backoff_s: float = 1.0  # delay before retrying a step that failed again; doubles up to backoff_max_s
    backoff_max_s: float = 60.0
    crash_loop_restarts: int = 3  # this many failures with no step of progress = crash loop
    startup_timeout_s: float = 600.0  # heartbeat silence allowed while starting/compiling
    restore_timeout_s: float = 600.0
    step_timeout_s: float = 120.0
    checkpoint_timeout_s: float = 600.0
    eval_timeout_s: float = 600.0  # heartbeat silence allowed during a held-out eval (eval.every_steps)
    poll_s: float = 0.5
    # a checkpoint that could not be written for want of space: wait this long for room for one more (an alert
    # meanwhile), then restart from the newest checkpoint; 0 = stop at once for a human (exit 81)
    storage_wait_minutes: float = 30.0


@dataclass
class LaunchConfig:
    processes: int = 1  # worker processes (one per host on GPUs); >1 forms a jax.distributed group
    mode: str = "local"  # local: N subprocesses on this machine | slurm: one srun step on the allocation
    processes_per_node: int = 1  # slurm: tasks per node (several emulate hosts on one node)
    min_processes: int = 0  # slurm: with no spare node left, shrink down to this many (0 = never shrink)
    suspect_retry_minutes: float = 0.0  # slurm: retry a suspect SLURM says is up after this long; shrunk: regrow
    coordinator_port: int = 0  # 0 = local: a free port, slurm: from the job id (20000-32767); + the attempt
    init_timeout_s: int = 300  # how long processes wait for each other in jax.distributed.initialize
    exit_grace_s: float = 30.0  # after one process exits cleanly, how long the others get to follow
    cpus_per_process: int = 0  # local: process i on its own CPUs, as if on its own host (test mode); 0 = any


@dataclass
class AlertsConfig:
    grad_window: int = 50  # grad-norm trend: compare the median of the last N steps with the N before
    grad_rise: float = 2.0  # ... and alert when it grew by this factor
    throughput_window: int = 50  # throughput: baseline = median tokens/s of the last N healthy steps
    throughput_drop: float = 0.7  # alert when recent tokens/s falls below this fraction of the baseline
    throughput_steps: int = 5  # ... as the median of this many consecutive steps (one slow step is noise)
    ecc_rise: int = 1  # new ECC errors between two health samples that mean "rising": checkpoint now
    overdue_fraction: float = 0.5  # supervisor alerts when heartbeat silence passes this part of the timeout


@dataclass
class StragglerConfig:
    """Which process slows the lockstep group (trainer.supervise.straggler): judged by the supervisor from the
    timing in every worker's heartbeat, with more than one process."""

    enabled: bool = True
    factor: float = 1.2  # verdict: one process's own time slows the group's step by this factor or more
    window_steps: int = 20  # clean steps per window (every process's), compared across processes
    windows: int = 2  # consecutive slow windows for a verdict (and calm ones to clear it)
    grace_steps: int = 5  # steps not counted after an attempt starts and after each save or eval
    mad_k: float = 3.0  # with 4+ processes: its excess must also pass mad_k x its peers' spread (MAD)
    action: str = "alert"  # alert | drain (slurm: checkpoint, restart without its node; a spare takes its place)


@dataclass
class RunbookConfig:
    enabled: bool = True  # detect loss spikes; the run then rewinds, skips, softens or gives up by itself
    window: int = 128  # rolling window (steps) of loss and grad-norm statistics
    warmup_steps: int = 100  # no statistical detection before this step (the fast early drop); NaN/Inf always
    min_history: int = 32  # steps in the window needed before judging (after a fresh start)
    loss_sigma: float = 6.0  # spike: loss > window mean + loss_sigma * std ...
    loss_min_rise: float = 0.1  # ... and > mean * (1 + loss_min_rise): a near-constant window is not a hair trigger
    grad_sigma: float = 6.0  # spike: grad norm > window mean + grad_sigma * std ...
    grad_min_rise: float = 1.0  # ... and > mean * (1 + grad_min_rise)
    grad_sustain: int = 2  # ... for this many steps in a row (lone grad-norm blips that clipping absorbs are normal)
    onset_sigma: float = 3.0  # steps right before a spike above this many sigma belong to it (where it began)
    probe_steps: int = 16  # after a spike, read up to this many more batches with updates frozen to find its end
    recur_distance: int = 100  # a spike within this many steps of an earlier action is a recurrence: soften
    lr_factor: float = 0.5  # soften: multiply the peak LR by this
    clip_factor: float = 0.5  # soften: multiply the gradient-clipping norm by this
    b2: float = 0.0  # soften: also set Adam b2 to this value (0 = leave b2 alone)
    max_actions: int = 5  # rewinds (skip or soften) before giving up with exit code 79


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
