"""A run's trained weights outside its training loop: the params alone of one checkpoint (no optimizer state),
restored onto one CPU device or onto a new run's mesh, whatever mesh and process count saved them; the model
config they were trained with. Used by `export`, `sample` and `train.init_from` (the tokenizer they were
trained with is found jax-free, by trainer.corpus.run_tokenizer).

Which checkpoint is read (newest verified, or a named one; never a live run's unsealed one) is decided
jax-free by trainer.observe.pick.
"""

from __future__ import annotations

import dataclasses
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
from trainer.model import hf
from trainer.model.model import GPT
from trainer.observe import pick
from trainer.store import ckpt_files as checkpoint_files
from trainer.store import manifest
from trainer.store.ckpt_files import STATE
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
