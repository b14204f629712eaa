"""The sections the worker trains with (run, mesh, model, data, eval, optim, train, checkpoint, log, integrity),
each with its rules: ranges and choices on the fields' types, the rules between its fields in its check()."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Annotated

from trainer.yamltree import ConfigError, NonNegative, OneOf, Positive, Range, Section


@dataclass
class RunConfig(Section):
    dir: str = "runs/default"  # run directory: checkpoints, events, TensorBoard, summary
    seed: int = 0  # seeds params init, dropout and the data order
    supervise: bool = True  # False runs the worker in this process (debugging)
    compile_cache: str = "~/.cache/trainer/jax"  # JAX persistent compilation cache ("" = off)
    deterministic: bool = False  # GPU: XLA's deterministic ops (bitwise resume on GPU; slower scatters)
    # The GPU settings below and run.deterministic are set in one place, trainer.xla_env (the reasons beside them)
    xla_latency_hiding: bool = False  # GPU: XLA's latency-hiding scheduler (overlaps collectives with compute)
    gpu_mem_fraction: float = 0.0  # GPU: share of memory jax's allocator takes (0 = jax's default, 0.75)

    def check(self, where: str) -> None:
        if not self.dir:
            raise ConfigError(f"{where}.dir must be set (e.g. --set {where}.dir=runs/mine)")
        if not 0.0 <= (fraction := self.gpu_mem_fraction) <= 1.0:
            raise ConfigError(f"{where}.gpu_mem_fraction must be in (0, 1] or 0 (jax's default), got {fraction}")


@dataclass
class MeshConfig(Section):
    data: int = -1  # -1 = whatever the other axes leave of the device count
    fsdp: Positive[int] = 1
    tensor: Positive[int] = 1
    cpu_devices: NonNegative[int] = 0  # >0: force this many fake CPU devices per process (test mode)

    def check(self, where: str) -> None:
        if self.data == 0 or self.data < -1:
            raise ConfigError(f"{where}.data must be > 0 or -1 (fill), got {self.data}")


# model.arch -> the parts that family implies, for each model key its YAML leaves unset (trainer.model.model).
ARCH_DEFAULTS = {  # gpt2: the ModelConfig defaults below are GPT-2's
    "gpt2": {},
    "llama": dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False),
}
REMAT = ("none", "full", "save_dots", "save_attention")  # model.remat's policies (trainer.model.model)


@dataclass
class ModelConfig(Section):
    arch: str = "gpt2"  # gpt2 | llama: the family whose parts the keys below default to (ARCH_DEFAULTS)
    vocab_size: Positive[int] = 384  # >= tokenizer vocab; a multiple of the tensor axis
    seq_len: Positive[int] = 128
    d_model: Positive[int] = 128
    n_layers: Positive[int] = 4
    n_heads: Positive[int] = 4
    n_kv_heads: NonNegative[int] = 0  # K/V heads (grouped-query attention; 1 = multi-query); 0 = n_heads
    d_ff: NonNegative[int] = 0  # MLP width; 0 = 4 * d_model (gelu), 8/3 * d_model rounded up to 64 (swiglu)
    position: Annotated[str, OneOf("learned", "rope")] = "learned"  # learned (GPT-2's wpe table) | rope (Llama's)
    rope_theta: Positive[float] = 10000.0  # rotary base (Llama 3: 500000)
    norm: Annotated[str, OneOf("layernorm", "rmsnorm")] = "layernorm"
    norm_eps: Positive[float] = 1e-5
    mlp: Annotated[str, OneOf("gelu", "swiglu")] = "gelu"  # gelu (tanh-GELU, GPT-2) | swiglu (gated, Llama's)
    qk_norm: bool = False  # RMSNorm of each head's q and k before attention (OLMo 2, Qwen 3)
    dropout: Annotated[float, Range(0, 1)] = 0.0
    compute_dtype: Annotated[str, OneOf("float32", "bfloat16")] = "float32"  # params stay fp32
    # auto = cudnn on GPU with bf16, else xla
    attention: Annotated[str, OneOf("auto", "xla", "xla_remat", "cudnn")] = "auto"
    remat: str = "none"  # what each block keeps for the backward pass: none | full | save_dots | save_attention
    scan: bool = True  # scan over layers (compile time flat in depth); false unrolls them
    tie_embeddings: bool = True
    bias: bool = True  # biases in the projections and LayerNorms (GPT-2); false drops them all (nanodo, OLMo)
    loss_chunk: NonNegative[int] = 0  # LM head + loss over slices of this many positions (model.loss); 0 = auto

    def check(self, where: str) -> None:
        if self.d_model % self.n_heads:
            raise ConfigError(f"{where}.d_model ({self.d_model}) must be divisible by {where}.n_heads ({self.n_heads})")
        if self.n_heads % (self.n_kv_heads or self.n_heads):
            raise ConfigError(
                f"{where}.n_heads ({self.n_heads}) must be a multiple of {where}.n_kv_heads ({self.n_kv_heads})"
            )
        if self.position == "rope" and (head := self.d_model // self.n_heads) % 2:
            raise ConfigError(f"{where}.position=rope needs an even head dim (d_model / n_heads = {head})")
        if self.loss_chunk and self.seq_len % self.loss_chunk:
            raise ConfigError(
                f"{where}.loss_chunk ({self.loss_chunk}) must divide {where}.seq_len ({self.seq_len}), or be 0 (auto)"
            )
        if self.remat not in REMAT:  # was a bool: say which policy the old value meant
            was = {"True": "; true is now full", "False": "; false is now none"}.get(self.remat, "")
            raise ConfigError(f"{where}.remat must be one of {', '.join(REMAT)}, got {self.remat!r}{was}")


@dataclass
class DataConfig(Section):
    path: str = ""  # prepared DIR, or raw text (file, directory, .jsonl, .parquet); "" = embedded stdlib corpus
    cache_dir: str = "~/.cache/trainer/data"  # where raw text paths are prepared once (content-keyed)
    tokenizer: str = "bytes"  # raw text only: bytes | bpe:N | path to a tokenizer.json | tiktoken:NAME
    text_field: str = "text"  # raw text only: the field of .jsonl records / column of .parquet files
    val_fraction: float = 0.02  # raw text only: share of whole documents held out for eval (fixed rule)
    # raw text only: tokenizer processes when preparing (output does not depend on it)
    prepare_workers: Positive[int] = 1
    batch_size: Positive[int] = 16  # global batch, in sequences
    shuffle: bool = True  # False = sequential window order (debugging)
    read_threads: Positive[int] = 2
    prefetch: NonNegative[int] = 4
    default_corpus_mb: Positive[float] = 4.0  # size cap of the embedded default corpus
    audit: bool = False  # record the global sample ids of every step (data audit)


@dataclass
class EvalConfig(Section):
    every_steps: NonNegative[int] = 0  # held-out loss every N steps (0 = off); never changes training
    batches: Positive[int] = 8  # global batches of fixed validation windows per eval


@dataclass
class OptimConfig(Section):
    lr: Positive[float] = 1e-3  # peak learning rate
    warmup_steps: NonNegative[int] = 20
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at train.steps
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # on the matrices that multiply activations (optim.DECAY_AXIS): not norms, biases, wpe
    clip_norm: Positive[float] = 1.0  # global-norm gradient clipping


@dataclass
class TrainConfig(Section):
    steps: Positive[int] = 200  # total steps: fixes the LR schedule
    stop_at_step: NonNegative[int] = 0  # >0: save and exit cleanly at this step without touching the schedule
    microbatches: Positive[int] = 1  # split each global batch into this many slices, gradients accumulated (memory)
    init_from: str = ""  # run dir, RUN/checkpoints/N or a local Hugging Face model dir: its params start a fresh run
    z_loss: NonNegative[float] = 0.0  # weight of mean(logsumexp(logits)^2) added to the loss (PaLM's 1e-4); 0 = off

    def check(self, where: str) -> None:
        if self.stop_at_step > self.steps:
            raise ConfigError(f"{where}.stop_at_step ({self.stop_at_step}) is past {where}.steps ({self.steps})")


@dataclass
class CheckpointConfig(Section):
    every_steps: NonNegative[int] = 50  # 0 = no step-based saves
    every_minutes: float | str = 0.0  # 0 = no time-based saves; "auto" = derive from stall and failure rate
    mtbf_hours: Positive[float] = 50000.0  # per-device MTBF assumed by "auto"
    auto_devices: NonNegative[int] = 0  # cluster size "auto" optimises for (0 = this run's device count)
    keep_latest: Positive[int] = 3
    keep_every: NonNegative[int] = 0  # also keep every Nth step forever (0 = off)
    async_save: bool = True
    verify: bool = True  # content manifests (sha256 per file) written after each save and checked before a restore
    # the durable tier: a directory on any shared file system ("" = RUN_DIR/checkpoints), or a bucket,
    # s3://BUCKET/PREFIX or gs://BUCKET/PREFIX (staged through RUN_DIR/checkpoints: trainer.store.bucket)
    durable_dir: str = ""
    # how long a save or a restore waits out a bucket that does not answer (retries with backoff) before it is
    # a storage failure (the supervisor then waits for the bucket, up to supervisor.storage_wait_minutes)
    bucket_patience_s: NonNegative[float] = 120.0
    local_dir: str = ""  # node-local directory (RAM disk, local NVMe) for the fast tier; "" = no local tier
    local_every_steps: NonNegative[int] = 0  # local-tier saves every N steps (0 = none by steps)
    # local-tier saves every M minutes (0 = none by time); keep_latest applies too
    local_every_minutes: NonNegative[float] = 0.0

    def check(self, where: str) -> None:
        """The rules, and every_minutes given as text ("30" from --set) read as a number."""
        m = self.every_minutes
        if isinstance(m, str) and m != "auto":
            try:
                m = float(m)
            except ValueError:
                raise ConfigError(f"{where}.every_minutes must be a number of minutes or 'auto', got {m!r}") from None
        if not isinstance(m, str) and (isinstance(m, bool) or m < 0):
            raise ConfigError(f"{where}.every_minutes must be >= 0 or 'auto', got {m!r}")
        self.every_minutes = m
        if "://" in self.durable_dir:
            scheme, _, rest = self.durable_dir.partition("://")  # parsed for use by trainer.store.bucket
            if scheme not in ("s3", "gs") or not rest.split("/")[0]:
                raise ConfigError(
                    f"{where}.durable_dir={self.durable_dir!r}: only s3:// and gs:// buckets are supported, as "
                    f"s3://BUCKET/PREFIX or gs://BUCKET/PREFIX"
                )
            if not self.verify:
                raise ConfigError(
                    f"{where}.verify=false with durable_dir={self.durable_dir!r}: in a bucket the content manifests "
                    f"are the commit markers; set verify=true"
                )
        elif self.durable_dir and not os.path.isabs(os.path.expanduser(self.durable_dir)):
            raise ConfigError(f"{where}.durable_dir must be an absolute path, got {self.durable_dir!r}")
        if bool(self.local_dir) != bool(self.local_every_steps or self.local_every_minutes):
            raise ConfigError(f"set {where}.local_dir and local_every_steps/_minutes together, or neither")


@dataclass
class LogConfig(Section):
    every_steps: Positive[int] = 10  # TensorBoard scalars, and the progress line off a terminal, every N steps
    tensorboard: bool = True
    progress: bool = True  # console progress line
    peak_flops: NonNegative[float] = 0.0  # per-device peak FLOP/s for MFU; 0 = look up the GPU table
    health: bool = True  # hardware-health collector and run alerts (off only to measure their cost)
    health_every_s: Positive[float] = 5.0  # seconds between hardware-health samples (background thread)
    report: bool = True  # write RUN_DIR/report/ (PNG plots + report.md) when a run ends


@dataclass
class IntegrityConfig(Section):
    # compare data-parallel copies of the params every N steps and before saves; 0 = off
    replica_check_steps: NonNegative[int] = 0
