"""A run's trained weights outside its training loop: the params alone of one checkpoint (no optimizer state),
restored onto one CPU device or onto a new run's mesh, whatever mesh and process count saved them; the model
config and the tokenizer they were trained with. Used by `export`, `sample` and `train.init_from`.

Which checkpoint is read (newest verified, or a named one; never a live run's unsealed one) is decided
jax-free by trainer.observe.pick.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import absl.logging
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from trainer.ckpt.checkpoint import agreed
from trainer.config import Config, ConfigError, ModelConfig
from trainer.corpus import shards, tokenizer
from trainer.model import hf
from trainer.model.model import GPT
from trainer.observe import pick
from trainer.observe.events import iter_events
from trainer.store import ckpt_files as checkpoint_files
from trainer.store import manifest, rundir
from trainer.store.ckpt_files import STATE
from trainer.store.event_names import DATA_READY
from trainer.yamltree import build

absl.logging.set_verbosity(absl.logging.ERROR)  # Orbax's info lines ("metadata file does not exist", ...)


@dataclasses.dataclass(frozen=True)
class Loaded:
    picked: pick.Picked
    meta: dict  # the checkpoint's metadata item: config, data fingerprint, mesh, processes, versions
    model: ModelConfig  # as trained
    params: Any  # pytree of arrays on one CPU device


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in path)


def read_meta(step_dir: Path) -> dict:
    """The checkpoint's metadata item, as saved."""
    return checkpoint_files.read_meta(step_dir).record


def model_config(meta: dict) -> ModelConfig:
    return build(ModelConfig, meta["config"]["model"], "model")


def saved_shapes(step_dir: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """path -> (shape, dtype) of every param in the checkpoint, from Orbax's metadata (no array is read)."""
    md = ocp.PyTreeCheckpointer().metadata(Path(step_dir).absolute() / STATE).item_metadata.tree
    leaves = jax.tree_util.tree_flatten_with_path(md["params"])[0]
    return {_path_str(p): (tuple(m.shape), str(np.dtype(m.dtype))) for p, m in leaves}


def abstract_params(cfg: ModelConfig) -> Any:
    """The param tree a model config builds (shapes and dtypes only: nothing is initialised; the attention
    kernel does not change them, and a GPU's cuDNN one would not trace on a CPU)."""
    model = GPT(dataclasses.replace(cfg, attention="xla"))
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, cfg.seq_len), jnp.int32))["params"])
    return nn.meta.unbox(boxed)


def check_shapes(want: Any, step_dir: Path, *, key: str) -> None:
    """ConfigError naming the first param whose shape differs between `want` and the checkpoint (or that
    only one of them has)."""
    have = saved_shapes(step_dir)
    mine = {_path_str(p): tuple(a.shape) for p, a in jax.tree_util.tree_flatten_with_path(want)[0]}
    for name in sorted(set(mine) | set(have)):
        a, b = mine.get(name), have.get(name, (None,))[0]
        if a != b:
            say = lambda s: "absent" if s is None else f"shape {list(s)}"  # noqa: E731
            raise ConfigError(
                f"{key}: param {name}: {say(a)} in this run's model, {say(b)} in {step_dir}; "
                f"set the model keys as that run had them"
            )


def init_params(init_from: dict, model: ModelConfig, target: Any) -> Any:
    """train.init_from's params laid out as `target` says (shapes, shardings): a checkpoint's restored by
    Orbax, a Hugging Face directory's read by every process, each placing the slices its devices hold."""
    src = Path(init_from["checkpoint"])
    if not init_from.get("format", "").startswith("huggingface"):
        return restore_params(src, target)
    host = hf.read_params(model, src, target)
    return jax.tree.map(lambda a, t: jax.make_array_from_callback(t.shape, t.sharding, lambda i: a[i]), host, target)


def restore_params(step_dir: Path, target: Any) -> Any:
    """The params of a checkpoint alone, restored as `target` says (shapes, dtypes, shardings): Orbax reads
    only their arrays, from whichever process shards wrote them."""
    item = {"params": target}
    args = ocp.args.PyTreeRestore(
        item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True
    )
    with ocp.PyTreeCheckpointer() as ck:
        return ck.restore(Path(step_dir).absolute() / STATE, args=args)["params"]


def on_cpu(picked: pick.Picked) -> Loaded:
    """The picked checkpoint's params on one CPU device (no mesh: a checkpoint of any mesh or process count)."""
    try:
        meta = read_meta(picked.dir)
    except Exception as e:  # only a checkpoint saved without manifests gets here damaged
        raise ConfigError(
            f"checkpoint {picked.dir}: its metadata item is unreadable ({type(e).__name__}); pick another checkpoint"
        ) from None
    cfg = model_config(meta)
    device = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract_params(cfg))
    check_shapes(target, picked.dir, key=str(picked.dir))  # a config that does not describe its own params
    return Loaded(picked, meta, cfg, restore_params(picked.dir, target))


def _agree(check) -> manifest.Problem | None:
    """Each process verifies its share of the checkpoint's files; the first problem any of them found."""
    return agreed(check).problem


def init_source(cfg: Config) -> dict | None:
    """train.init_from resolved to one verified checkpoint whose params fit this run's model (ConfigError
    naming the first param that does not), checked before the run writes anything."""
    if not cfg.train.init_from:
        return None
    path = Path(cfg.train.init_from).expanduser()
    if hf.is_model_dir(path):  # a Hugging Face model directory on disk (config.json + safetensors)
        kind = hf.check_config(cfg.model, path)["model_type"]
        return {"path": cfg.train.init_from, "checkpoint": str(path.absolute()), "format": f"huggingface {kind}"}
    try:
        picked = pick.pick(
            cfg.train.init_from,
            agree=_agree,
            share=(jax.process_index(), jax.process_count()),
            name_it=f"a step path, RUN_DIR/{checkpoint_files.CHECKPOINTS}/STEP",
        )
    except ConfigError as e:
        raise ConfigError(f"train.init_from: {e}") from None
    check_shapes(abstract_params(cfg.model), picked.dir, key="train.init_from")
    return {
        "path": cfg.train.init_from,
        "checkpoint": str(picked.dir.absolute()),
        "from_step": picked.step,
        "verified": picked.verified,
        **({"skipped": picked.notes} if picked.notes else {}),
    }


@dataclasses.dataclass(frozen=True)
class RunTokenizer:
    name: str  # as meta.json names it: bytes | bpe:N | tokenizer.json sha256:... | tiktoken:NAME | imported tokens
    eos_id: int
    dir: Path | None  # the prepared DIR it was read from; None: the bytes tokenizer (no file to find)

    @property
    def file(self) -> Path | None:
        """The Hugging Face tokenizer.json (bpe:N and tokenizer.json specs), exported with the model."""
        f = self.dir / tokenizer.HF_FILE if self.dir else None
        return f if f and f.is_file() else None

    def load(self) -> tokenizer.Tok:
        """The tokenizer itself (to encode and decode); ConfigError when the run has none."""
        if self.name == IMPORTED:
            raise ConfigError(
                f"the run trained on imported token ids ({self.dir}): there is no tokenizer to "
                f"encode or decode text with"
            )
        return tokenizer.of_prepared(self.name, self.file)


IMPORTED = "imported tokens"  # meta.json's tokenizer for `prepare --from-tokens`


def tokenizer_of(run_dir: Path | None, meta: dict) -> RunTokenizer:
    """The tokenizer of the data the checkpoint was trained on: found through data.path or the run's
    `data_ready` events, and checked against the checkpoint's data fingerprint."""
    data = meta["config"]["data"]
    ready = None
    if run_dir is not None:  # every start logs one; the data cannot change on resume, so the first one suffices
        ready = next((e for e in iter_events(Path(run_dir) / rundir.EVENTS) if e["event"] == DATA_READY), None)
    places = [Path(p).expanduser() for p in (data["path"], (ready or {}).get("dir")) if p]
    for d in places:
        if shards.is_prepared(d):
            prepared = json.loads((d / shards.META).read_text())
            if prepared["fingerprint"] == meta["data_fingerprint"]:
                return RunTokenizer(prepared["tokenizer"], prepared["eos_id"], d)
    # The bytes tokenizer needs no file: enough to know that the run used it.
    path = Path(data["path"]).expanduser()
    raw = not data["path"] or (path.exists() and not shards.is_prepared(path))  # data.tokenizer applied to it
    name = ready["tokenizer"] if ready else data["tokenizer"] if raw else None
    if name == tokenizer.BYTES.name:
        return RunTokenizer(name, tokenizer.BYTES.eos_id, None)
    raise ConfigError(
        f"the data this checkpoint was trained on (tokenizer {name or data['tokenizer']!r}, fingerprint "
        f"{meta['data_fingerprint'][:12]}) is not where the run found it "
        f"({', '.join(map(str, places)) or 'no data_ready event'}); prepare it again there"
    )
