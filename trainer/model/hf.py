"""Hugging Face's model formats, both ways: our param tree (trainer.model.model) as `GPT2LMHeadModel` or
`LlamaForCausalLM` tensors and config.json (for `export`), and a local Hugging Face model directory read back
into our param tree (for `train.init_from`; never downloaded).

Every conversion is a renaming, a reshape and a transpose: no arithmetic, so a directory read in and
written out again gives back its tensors bit for bit.
- GPT-2's Conv1D weights are [in, out], as our kernels are; c_attn is [D, (q | k | v)] with heads inside.
- Llama's nn.Linear weights are [out, in]: our kernels transposed. q_proj's rows are (head, dim), as our
  q kernel's columns; K/V likewise with num_key_value_heads. Rotary positions: our model uses Hugging
  Face's convention (a head's dims rotated in halves, rotate_half), so q and k need no permutation (Meta's
  original checkpoints interleave pairs, which HF's conversion script permutes away).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np

from trainer.config import ARCH_DEFAULTS, ConfigError, ModelConfig
from trainer.model.model import kv_heads, mlp_width

CONFIG, MODEL = "config.json", "model.safetensors"
GPT2, LLAMA = "gpt2", "llama"
# The parts each Hugging Face class has (beyond sizes): a model with other parts exports to neither.
PARTS = {
    GPT2: {"position": "learned", "norm": "layernorm", "mlp": "gelu", "qk_norm": False},
    LLAMA: {**{k: v for k, v in ARCH_DEFAULTS["llama"].items() if k != "tie_embeddings"}, "qk_norm": False},
}


def family(cfg: ModelConfig) -> str:
    """gpt2 or llama: the Hugging Face class that holds this model exactly (ConfigError naming the first
    key that keeps it out of model.arch's class)."""
    fam = LLAMA if cfg.arch == "llama" else GPT2
    for key, want in PARTS[fam].items():
        if getattr(cfg, key) != want:
            cls = "LlamaForCausalLM" if fam == LLAMA else "GPT2LMHeadModel"
            raise ConfigError(
                f"model.{key}={getattr(cfg, key)!r}: {cls} (model.arch={cfg.arch}) has {key} {want!r}, and no "
                f"other Hugging Face class this exports to holds the model as configured"
            )
    if fam == GPT2 and kv_heads(cfg) != cfg.n_heads:
        raise ConfigError(
            f"model.n_kv_heads={cfg.n_kv_heads}: GPT2LMHeadModel has one K/V head per query head; "
            "set model.arch=llama for grouped-query attention"
        )
    return fam


def _layer(p: dict, cfg: ModelConfig, i: int) -> dict:
    """Block i's params: a slice of the scanned stack, or block_i of an unrolled model."""
    return jax.tree.map(lambda a: a[i], p["blocks"]) if cfg.scan else p[f"block_{i}"]


def _qkv(b: dict, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q [D, H, K], k and v [D, G, K] from either attention layout (fused qkv, or q and kv)."""
    if "qkv" in b:
        w = b["qkv"]["kernel"]
        return w[:, 0], w[:, 1], w[:, 2]
    return b["q"]["kernel"], b["kv"]["kernel"][:, 0], b["kv"]["kernel"][:, 1]


def _bias(module: dict, size: int) -> np.ndarray:
    """A module's bias as a vector; zeros (GPT-2's equivalent of none) for a model.bias: false model."""
    return module["bias"].reshape(size) if "bias" in module else np.zeros(size, np.float32)


def tensors(params, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Our params under the Hugging Face class's names and layouts, fp32."""
    p = jax.device_get(params)
    out = _gpt2(p, cfg) if family(cfg) == GPT2 else _llama(p, cfg)
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def _gpt2(p: dict, cfg: ModelConfig) -> dict:
    D, F = cfg.d_model, mlp_width(cfg)
    out = {
        "transformer.wte.weight": p["wte"],
        "transformer.wpe.weight": p["wpe"],
        "transformer.ln_f.weight": p["ln_f"]["scale"],
        "transformer.ln_f.bias": _bias(p["ln_f"], D),
    }
    for i in range(cfg.n_layers):
        b, h = _layer(p, cfg, i), f"transformer.h.{i}."
        out.update(
            {
                h + "ln_1.weight": b["ln_1"]["scale"],
                h + "ln_1.bias": _bias(b["ln_1"], D),
                # [D, T, H, K] row-major is [D, (q | k | v), each split into heads]: c_attn's [D, 3D] columns.
                h + "attn.c_attn.weight": b["qkv"]["kernel"].reshape(D, 3 * D),
                h + "attn.c_attn.bias": _bias(b["qkv"], 3 * D),
                h + "attn.c_proj.weight": b["proj"]["kernel"].reshape(D, D),  # [H, K, D] -> [H*K, D]
                h + "attn.c_proj.bias": _bias(b["proj"], D),
                h + "ln_2.weight": b["ln_2"]["scale"],
                h + "ln_2.bias": _bias(b["ln_2"], D),
                h + "mlp.c_fc.weight": b["fc"]["kernel"],
                h + "mlp.c_fc.bias": _bias(b["fc"], F),
                h + "mlp.c_proj.weight": b["out"]["kernel"],
                h + "mlp.c_proj.bias": _bias(b["out"], D),
            }
        )
    if not cfg.tie_embeddings:  # tied: GPT2LMHeadModel takes its head from wte (no lm_head tensor is saved)
        out["lm_head.weight"] = p["lm_head"].T
    return out


def _llama(p: dict, cfg: ModelConfig) -> dict:
    D = cfg.d_model
    out = {"model.embed_tokens.weight": p["wte"], "model.norm.weight": p["ln_f"]["scale"]}
    for i in range(cfg.n_layers):
        b, h = _layer(p, cfg, i), f"model.layers.{i}."
        q, k, v = _qkv(b, cfg)
        out.update(
            {
                h + "input_layernorm.weight": b["ln_1"]["scale"],
                h + "self_attn.q_proj.weight": q.reshape(D, -1).T,  # [D, H, K] -> [H*K, D]
                h + "self_attn.k_proj.weight": k.reshape(D, -1).T,  # [D, G, K] -> [G*K, D]
                h + "self_attn.v_proj.weight": v.reshape(D, -1).T,
                h + "self_attn.o_proj.weight": b["proj"]["kernel"].reshape(-1, D).T,  # [H, K, D] -> [D, H*K]
                h + "post_attention_layernorm.weight": b["ln_2"]["scale"],
                h + "mlp.gate_proj.weight": b["gate_up"]["kernel"][:, 0].T,  # [D, F] -> [F, D]
                h + "mlp.up_proj.weight": b["gate_up"]["kernel"][:, 1].T,
                h + "mlp.down_proj.weight": b["out"]["kernel"].T,  # [F, D] -> [D, F]
            }
        )
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = p["lm_head"].T
    return out


def config_json(cfg: ModelConfig, eos_id: int) -> dict:
    """The Hugging Face config.json of our model: the vocabulary as the model has it (padding included)."""
    common = {
        "vocab_size": cfg.vocab_size,
        "initializer_range": 0.02,
        "tie_word_embeddings": cfg.tie_embeddings,
        "use_cache": True,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }
    if family(cfg) == GPT2:
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_positions": cfg.seq_len,
            "n_ctx": cfg.seq_len,
            "n_embd": cfg.d_model,
            "n_layer": cfg.n_layers,
            "n_head": cfg.n_heads,
            "n_inner": mlp_width(cfg),
            "activation_function": "gelu_new",
            "layer_norm_epsilon": cfg.norm_eps,
            "resid_pdrop": cfg.dropout,
            "embd_pdrop": cfg.dropout,
            "attn_pdrop": 0.0,  # we have no dropout on attention weights
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            **common,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.d_model,
        "intermediate_size": mlp_width(cfg),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": kv_heads(cfg),
        "head_dim": cfg.d_model // cfg.n_heads,
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        **common,
    }


# --- in: a local Hugging Face directory as train.init_from ----------------------------------------------


def is_model_dir(path: Path) -> bool:
    return (path / CONFIG).is_file() and any(path.glob("*.safetensors"))


def _expect(hf: dict, d: Path) -> dict[str, object]:
    """The model keys (and values) a Hugging Face config.json implies; ConfigError for what we cannot hold."""
    kind = hf.get("model_type")
    if kind == GPT2:
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ConfigError(f"train.init_from: {d}: activation_function {act!r}; only the tanh GELU (gelu_new)")
        return {
            "arch": "gpt2",
            "d_model": hf["n_embd"],
            "n_layers": hf["n_layer"],
            "n_heads": hf["n_head"],
            "d_ff": hf.get("n_inner") or 4 * hf["n_embd"],
            "norm_eps": hf.get("layer_norm_epsilon", 1e-5),
            "vocab_size": hf["vocab_size"],
            "tie_embeddings": hf.get("tie_word_embeddings", True),
        }
    if kind == LLAMA:
        for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False), ("rope_scaling", None)):
            if hf.get(key, ok) != ok:
                raise ConfigError(f"train.init_from: {d}: {key}={hf[key]!r} is not supported (needs {ok!r})")
        H = hf["num_attention_heads"]
        if hf.get("head_dim", hf["hidden_size"] // H) * H != hf["hidden_size"]:
            raise ConfigError(f"train.init_from: {d}: head_dim x num_attention_heads != hidden_size")
        return {
            "arch": "llama",
            "d_model": hf["hidden_size"],
            "n_layers": hf["num_hidden_layers"],
            "n_heads": H,
            "n_kv_heads": hf.get("num_key_value_heads") or H,
            "d_ff": hf["intermediate_size"],
            "norm_eps": hf.get("rms_norm_eps", 1e-6),
            "rope_theta": hf.get("rope_theta", 10000.0),
            "vocab_size": hf["vocab_size"],
            "tie_embeddings": hf.get("tie_word_embeddings", False),
        }
    raise ConfigError(f"train.init_from: {d}: model_type {kind!r}; only gpt2 and llama directories are read")


def check_config(cfg: ModelConfig, d: Path) -> dict:
    """config.json of the directory, checked against the run's model keys: ConfigError naming the first
    key that differs (with the value to set), or a part the class does not have."""
    try:
        hf = json.loads((d / CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"train.init_from: {d / CONFIG} is unreadable ({e})") from None
    family(cfg)  # parts the Hugging Face classes do not have (QK-norm, a mixture) cannot come from one
    mine = {**dataclasses.asdict(cfg), "d_ff": mlp_width(cfg), "n_kv_heads": kv_heads(cfg)}
    for key, want in _expect(hf, d).items():
        if mine[key] != want and not (isinstance(want, float) and np.float32(mine[key]) == np.float32(want)):
            raise ConfigError(
                f"train.init_from: {d} has model.{key}={want!r}, this run's model has {mine[key]!r}; "
                f"set model.{key}={want}"
            )
    if hf["model_type"] == GPT2 and cfg.seq_len > hf.get("n_positions", 1024):
        raise ConfigError(f"train.init_from: {d} has {hf['n_positions']} learned positions; set model.seq_len <= that")
    return hf


def _read(d: Path) -> dict[str, np.ndarray]:
    """Every tensor of the directory's safetensors files, fp32 on the host (bf16 and fp16 widen exactly)."""
    from safetensors import safe_open

    out = {}
    cpu = jax.devices("cpu")[0]
    for f in sorted(d.glob("*.safetensors")):
        # the flax reader knows bfloat16 (numpy's does not); kept on the host's CPU device
        with jax.default_device(cpu), safe_open(str(f), framework="flax") as st:
            out.update({k: np.asarray(st.get_tensor(k)).astype(np.float32) for k in st.keys()})  # noqa: SIM118
    return out


def _take(t: dict, name: str, shape: tuple[int, ...], d: Path) -> np.ndarray:
    if name not in t:
        raise ConfigError(f"train.init_from: {d} has no tensor {name}; is it a complete model directory?")
    if t[name].shape != shape:
        raise ConfigError(
            f"train.init_from: {d}: {name} has shape {list(t[name].shape)}, this run's model needs {list(shape)}"
        )
    return t.pop(name)


def read_params(cfg: ModelConfig, d: Path, abstract) -> dict:
    """The directory's tensors as our param tree (the run's model, scanned or not); ConfigError for a
    missing or misshapen tensor, or one the model has no place for."""
    t = _read(d)
    D, H, G, F, V, N = cfg.d_model, cfg.n_heads, kv_heads(cfg), mlp_width(cfg), cfg.vocab_size, cfg.n_layers
    K = D // H
    layers = []
    if family(cfg) == GPT2:
        top = {"wte": _take(t, "transformer.wte.weight", (V, D), d)}
        n_pos = t["transformer.wpe.weight"].shape[0] if "transformer.wpe.weight" in t else cfg.seq_len
        top["wpe"] = _take(t, "transformer.wpe.weight", (n_pos, D), d)[: cfg.seq_len]
        top["ln_f"] = _norm(t, "transformer.ln_f", D, cfg, d)
        for i in range(N):
            h = f"transformer.h.{i}."
            layers.append(
                {
                    "ln_1": _norm(t, h + "ln_1", D, cfg, d),
                    "qkv": _linear(t, h + "attn.c_attn", (D, 3 * D), (D, 3, H, K), (3, H, K), cfg, d),
                    "proj": _linear(t, h + "attn.c_proj", (D, D), (H, K, D), (D,), cfg, d),
                    "ln_2": _norm(t, h + "ln_2", D, cfg, d),
                    "fc": _linear(t, h + "mlp.c_fc", (D, F), (D, F), (F,), cfg, d),
                    "out": _linear(t, h + "mlp.c_proj", (F, D), (F, D), (D,), cfg, d),
                }
            )
    else:
        top = {"wte": _take(t, "model.embed_tokens.weight", (V, D), d)}
        top["ln_f"] = {"scale": _take(t, "model.norm.weight", (D,), d)}
        for i in range(N):
            h = f"model.layers.{i}."
            w = lambda name, shape, h=h: _take(t, h + name + ".weight", shape, d).T  # noqa: E731  [out, in] -> [in, out]
            q, k, v = (
                w("self_attn.q_proj", (H * K, D)),
                w("self_attn.k_proj", (G * K, D)),
                w("self_attn.v_proj", (G * K, D)),
            )
            b = {
                "ln_1": {"scale": _take(t, h + "input_layernorm.weight", (D,), d)},
                "proj": {"kernel": w("self_attn.o_proj", (D, H * K)).reshape(H, K, D)},
                "ln_2": {"scale": _take(t, h + "post_attention_layernorm.weight", (D,), d)},
                "gate_up": {"kernel": np.stack([w("mlp.gate_proj", (F, D)), w("mlp.up_proj", (F, D))], axis=1)},
                "out": {"kernel": w("mlp.down_proj", (D, F))},
            }
            if G == H:
                b["qkv"] = {"kernel": np.stack([q, k, v], axis=1).reshape(D, 3, H, K)}
            else:
                b["q"] = {"kernel": q.reshape(D, H, K)}
                b["kv"] = {"kernel": np.stack([k, v], axis=1).reshape(D, 2, G, K)}
            layers.append(b)
    if cfg.tie_embeddings:
        t.pop("lm_head.weight", None)  # some directories save the tied copy too
    else:
        top["lm_head"] = _take(t, "lm_head.weight", (V, D), d).T
    if t:
        raise ConfigError(f"train.init_from: {d} has tensors this model has no place for: {', '.join(sorted(t)[:3])}")
    if cfg.scan:
        top["blocks"] = jax.tree.map(lambda *xs: np.stack(xs), *layers)
    else:
        top.update({f"block_{i}": b for i, b in enumerate(layers)})
    want = jax.tree.structure(abstract)
    if jax.tree.structure(top) != want:
        raise ConfigError(f"train.init_from: {d}: the tensors do not make this run's param tree")
    return top


def _norm(t: dict, name: str, D: int, cfg: ModelConfig, d: Path) -> dict:
    out = {"scale": _take(t, name + ".weight", (D,), d)}
    bias = _take(t, name + ".bias", (D,), d)
    return _with_bias(out, bias, name, cfg, d)


def _linear(t, name, hf_shape, kernel_shape, bias_shape, cfg, d) -> dict:
    out = {"kernel": _take(t, name + ".weight", hf_shape, d).reshape(kernel_shape)}
    bias = _take(t, name + ".bias", (int(np.prod(bias_shape)),), d).reshape(bias_shape)
    return _with_bias(out, bias, name, cfg, d)


def _with_bias(out: dict, bias: np.ndarray, name: str, cfg: ModelConfig, d: Path) -> dict:
    """GPT-2 always saves biases; a model.bias: false model takes them only when they are zeros (as our
    export writes them)."""
    if cfg.bias:
        return {**out, "bias": bias}
    if np.any(bias):
        raise ConfigError(f"train.init_from: {d}: {name}.bias is not zero and model.bias is false; set model.bias=true")
    return out
