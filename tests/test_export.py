"""The model leaves the trainer: `export` writes a Hugging Face GPT-2 directory that an independent GPT-2 forward
pass (numpy, written here from the GPT-2 definition, reading only config.json and model.safetensors) agrees
with; `sample` decodes as that forward pass does; a checkpoint of any mesh or process count exports to the
same tensors as the trainer's own sharded restore of it; `train.init_from` starts a run from another run's
params, never re-applied on resume; a run that still trains is exported only at a named, sealed checkpoint."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    MICRO,
    ROOT,
    TINY,
    child_env,
    events,
    need_transformers,
    run_trainer,
    step_losses,
    summary,
    trainer_cmd,
)
from multihost import ONE, group_overrides, small_corpus, wait_for
from multihost import reference as group_reference
from safetensors import safe_open
from safetensors.numpy import load_file

from trainer.store import event_names as E

pytestmark = pytest.mark.slow  # every test here trains end to end (fast loop: -m 'not slow')

# --- an independent GPT-2 (Radford et al. 2019, as Hugging Face's GPT2LMHeadModel computes it) ----------


def gpt2_names(n_layer: int) -> set[str]:
    """Every tensor name of a tied GPT2LMHeadModel's safetensors (lm_head is wte)."""
    per_layer = ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj")
    return {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight", "transformer.ln_f.bias"} | {
        f"transformer.h.{i}.{m}.{p}" for i in range(n_layer) for m in per_layer for p in ("weight", "bias")
    }


def gpt2_logits(cfg: dict, w: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """Logits [T, V] for token ids [T], in float64, from the exported files alone."""
    assert cfg["model_type"] == "gpt2" and cfg["activation_function"] == "gelu_new"
    D, H, eps = cfg["n_embd"], cfg["n_head"], cfg["layer_norm_epsilon"]
    K, T = D // H, len(ids)
    g = lambda name: w[name].astype(np.float64)  # noqa: E731

    def norm(x, name):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * g(name + ".weight") + g(name + ".bias")

    def gelu_new(x):  # GPT-2's tanh approximation
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))

    def heads(a):  # [T, D] -> [H, T, K]
        return a.reshape(T, H, K).transpose(1, 0, 2)

    x = g("transformer.wte.weight")[ids] + g("transformer.wpe.weight")[:T]
    causal = np.tril(np.ones((T, T), bool))
    for i in range(cfg["n_layer"]):
        p = f"transformer.h.{i}."
        qkv = norm(x, p + "ln_1") @ g(p + "attn.c_attn.weight") + g(p + "attn.c_attn.bias")  # Conv1D: x @ W + b
        q, k, v = (heads(a) for a in np.split(qkv, 3, axis=-1))
        scores = np.where(causal, q @ k.transpose(0, 2, 1) / np.sqrt(K), -np.inf)
        att = np.exp(scores - scores.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        o = (att @ v).transpose(1, 0, 2).reshape(T, D)
        x = x + o @ g(p + "attn.c_proj.weight") + g(p + "attn.c_proj.bias")
        h = gelu_new(norm(x, p + "ln_2") @ g(p + "mlp.c_fc.weight") + g(p + "mlp.c_fc.bias"))
        x = x + h @ g(p + "mlp.c_proj.weight") + g(p + "mlp.c_proj.bias")
    head = g("transformer.wte.weight") if cfg["tie_word_embeddings"] else g("lm_head.weight")
    return norm(x, "transformer.ln_f") @ head.T


def gpt2_greedy(cfg: dict, w: dict, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with the context cropped to n_positions; stops after end-of-text, like HF's generate."""
    ids, new = list(prompt), []
    for _ in range(n):
        new.append(int(np.argmax(gpt2_logits(cfg, w, ids[-cfg["n_positions"] :])[-1])))
        ids.append(new[-1])
        if new[-1] == cfg["eos_token_id"]:
            break
    return new


# --- helpers -------------------------------------------------------------------------------------------

FINE_TUNE = ("train.steps=8", "checkpoint.every_steps=3", "optim.warmup_steps=2")


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env or child_env(),
    )


def export(run: Path, out: Path, *more: str) -> dict[str, str]:
    """`export` asserted to succeed: sha256 of each exported tensor, plus the provenance in the header."""
    p = cli("export", str(run), "--out", str(out), *more)
    assert p.returncode == 0, p.stderr
    return export_hashes(out)


def export_hashes(out: Path) -> dict[str, str]:
    with safe_open(str(out / "model.safetensors"), "np") as f:
        meta = f.metadata()
    tensors = load_file(str(out / "model.safetensors"))
    return {**{k: hashlib.sha256(v.tobytes()).hexdigest() for k, v in tensors.items()}, "__meta__": meta}


def tree_bytes(d: Path) -> dict[str, str]:
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()
    }


def newest(run: Path) -> int:
    return max(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())


@pytest.fixture(scope="module")
def group(tmp_path_factory) -> tuple[Path, Path]:
    """(run, corpus): the session's uninterrupted 2-process x 2-device micro run (fp32, 30 steps, a corpus
    of a few words: its greedy continuations are not one repeated byte)."""
    return group_reference(tmp_path_factory)


@pytest.fixture(scope="module")
def exported(group, tmp_path_factory) -> tuple[Path, Path]:
    """(run, export dir) of the 2-process run, exported on one CPU device."""
    run, _ = group
    before = tree_bytes(run)
    out = tmp_path_factory.mktemp("export") / "gpt2"
    meta = export(run, out)["__meta__"]
    assert tree_bytes(run) == before  # exporting reads the run dir, never writes it
    assert meta["trainer_step"] == "30" and meta["trainer_params_sha256"] == summary(run)["params_sha256"]
    return run, out


@pytest.fixture(scope="module")
def fine_tuned(group, tmp_path_factory) -> Path:
    """8 steps on 1 process x 4 devices (data 2 x fsdp 2) from the 2-process run's params."""
    source, corpus = group
    run = tmp_path_factory.mktemp("init_from") / "whole"
    run_trainer(run, *group_overrides(corpus, *ONE, *FINE_TUNE, f"train.init_from={source}"), worker=True)
    return run


@pytest.fixture(scope="module")
def bpe_export(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(run, prepared DIR, export dir) of 2 steps on one device with a 300-token BPE trained on its text; the
    export dir's parents did not exist (README's `--out exports/tiny` on a fresh clone)."""
    root = tmp_path_factory.mktemp("bpe")
    run, out = root / "run", root / "exports" / "nested" / "gpt2"
    run_trainer(
        run,
        f"data.path={small_corpus(root)}",
        f"data.cache_dir={root / 'cache'}",
        "data.tokenizer=bpe:300",
        "train.steps=2",
        "checkpoint.every_steps=0",
        "mesh.cpu_devices=1",
        "mesh.data=1",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        "log.report=false",
        worker=True,
    )
    export(run, out)
    return run, Path(next(e["dir"] for e in events(run) if e["event"] == E.DATA_READY)), out


def trainer_logits(run: Path, ids: list[int]) -> np.ndarray:
    """The trainer's own forward pass on the run's newest verified checkpoint, restored on one CPU device."""
    import jax

    from trainer.ckpt import weights
    from trainer.model.model import GPT
    from trainer.observe import pick

    loaded = weights.on_cpu(pick.pick(run))
    assert loaded.model.compute_dtype == "float32"  # the comparisons are of fp32 math
    return np.asarray(jax.jit(GPT(loaded.model).apply)({"params": loaded.params}, np.asarray([ids], np.int32))[0])


# --- 1: the exported files are GPT-2, and `sample` decodes like it ------------------------------------

TEXT = b"window token a restore order window loss order epoch mesh shard loss shard step restore shard loss"


def test_independent_gpt2_forward_matches_the_trainer_and_greedy_sample(exported):
    from trainer.model.model import LN_EPS

    run, out = exported
    cfg, w = json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))
    assert (cfg["n_embd"], cfg["n_layer"], cfg["n_head"], cfg["n_positions"], cfg["vocab_size"]) == (64, 2, 4, 64, 384)
    assert cfg["layer_norm_epsilon"] == LN_EPS and cfg["eos_token_id"] == 256 and cfg["tie_word_embeddings"]
    assert set(w) == gpt2_names(n_layer=2)
    assert w["transformer.h.0.attn.c_attn.weight"].shape == (64, 192) and w["transformer.wte.weight"].shape == (384, 64)
    ids = list(TEXT[:64])
    ours, theirs = trainer_logits(run, ids), gpt2_logits(cfg, w, ids)
    diff = float(np.abs(ours - theirs).max())
    print(
        f"logits max abs diff, trainer (fp32) vs independent numpy GPT-2: {diff:.2e} (logit range "
        f"{theirs.min():.1f}..{theirs.max():.1f})"
    )
    assert diff < 1e-4

    # 98 bytes of prompt: past model.seq_len (64), so both crop the context.
    p = cli("sample", str(run), "--prompt", TEXT.decode(), "--temperature", "0", "--max-new-tokens", "16", "--json")
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert got["prompt_ids"] == list(TEXT)
    want = gpt2_greedy(cfg, w, got["prompt_ids"], 16)
    print(f"greedy: sample {got['text']!r} == numpy GPT-2 {bytes(want).decode()!r}: {got['new_ids'] == want}")
    assert got["new_ids"] == want and got["text"] == bytes(want).decode() and len(set(want)) > 1


def test_sample_top_k_seed_and_an_empty_prompt(exported):
    """README's `sample` flags: `--prompt ""` starts from end-of-text; `--top-k 1` draws the greedy token at any
    temperature; `--seed` fixes the draws (the CLI's text is the one the same seed gives in this process, and
    another seed gives another)."""
    from trainer.ckpt import weights
    from trainer.observe import pick
    from trainer.tools.sample import generate

    run, _ = exported
    loaded = weights.on_cpu(pick.pick(str(run), None))

    def draw(*args: str) -> dict:
        p = cli("sample", str(run), "--max-new-tokens", "12", "--json", *args)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)

    eos = 256  # the byte tokenizer's end-of-text
    top1 = draw("--prompt", "", "--temperature", "2", "--top-k", "1", "--seed", "5")
    assert top1["prompt_ids"] == [eos], top1
    assert top1["new_ids"] == generate(loaded, [eos], max_new_tokens=12, eos_id=eos), top1
    hot = draw("--prompt", "the ", "--temperature", "1.5", "--seed", "1")
    again = dict(max_new_tokens=12, temperature=1.5, eos_id=eos)
    assert hot["new_ids"] == generate(loaded, hot["prompt_ids"], seed=1, **again), hot
    assert hot["new_ids"] != generate(loaded, hot["prompt_ids"], seed=2, **again), hot


def test_a_bias_free_model_exports_as_gpt2_with_zero_biases():
    """model.bias: false (no biases, as in nanodo and OLMo) exports GPT-2's full tensor set, its biases zero,
    and the independent GPT-2 computes the trainer's logits from it. No training run: random params."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from trainer.config import ModelConfig
    from trainer.model.hf import config_json, tensors
    from trainer.model.model import GPT

    cfg = ModelConfig(vocab_size=384, seq_len=32, d_model=64, n_layers=2, n_heads=4, bias=False)
    model = GPT(cfg)
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, cfg.seq_len), jnp.int32))["params"])
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))  # norm scales off 1 too: every param matters
    params = tree.unflatten([p + 0.05 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)])
    w = tensors(params, cfg)
    assert set(w) == gpt2_names(n_layer=2)
    assert all(not w[k].any() for k in w if k.endswith(".bias"))
    ids = list(TEXT[:32])
    ours = np.asarray(jax.jit(model.apply)({"params": params}, np.asarray([ids], np.int32))[0])
    diff = float(np.abs(ours - gpt2_logits(config_json(cfg, 256), w, ids)).max())
    print(f"bias-free export: logits max abs diff vs independent numpy GPT-2 {diff:.2e}")
    assert diff < 1e-4


def test_a_prepared_tokenizer_is_exported_and_sample_uses_it(bpe_export):
    from tokenizers import Tokenizer

    run, prepared, out = bpe_export
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert (out / "tokenizer.json").read_bytes() == (prepared / "tokenizer.json").read_bytes()
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    eos = json.loads((out / "config.json").read_text())["eos_token_id"]
    assert eos == tok.token_to_id("<|endoftext|>") and json.loads((out / "tokenizer_config.json").read_text()) == {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "bos_token": "<|endoftext|>",
        "model_max_length": 64,
    }
    p = cli("sample", str(run), "--prompt", "the data step", "--max-new-tokens", "8", "--seed", "3", "--json")
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert got["prompt_ids"] == tok.encode("the data step").ids
    # Exactly the draws of seed 3 at the default temperature 0.8 (the same seed gives the same text in any
    # process), decoded by the prepared tokenizer.
    from trainer.ckpt import weights
    from trainer.observe import pick
    from trainer.tools.sample import generate

    loaded = weights.on_cpu(pick.pick(str(run), None))
    want = generate(loaded, got["prompt_ids"], max_new_tokens=8, temperature=0.8, seed=3, eos_id=eos)
    assert got["new_ids"] == want, (got, want)
    assert got["text"] == tok.decode([i for i in got["new_ids"] if i != eos], skip_special_tokens=False)


def _without_torch(tmp_path: Path) -> dict[str, str]:
    """child_env() where `import torch` and `import transformers` fail as if they were not installed."""
    shim = tmp_path / "no-torch"
    for name in ("torch", "transformers"):
        (shim / name).mkdir(parents=True)
        (shim / name / "__init__.py").write_text(f"raise ModuleNotFoundError('{name} is not installed (test shim)')\n")
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), env.get("PYTHONPATH", "")]))
    return env


def test_export_creates_missing_parents_atomically_and_refuses_a_non_empty_out(bpe_export, tmp_path):
    """README: `--out` must be new (its missing parents made, the fixture's case; the directory appears whole:
    nothing but it beside it afterwards) or empty; an existing non-empty --out, or a parent that is a file, is
    refused in one line and nothing is written; a refused export creates no parent. Neither torch nor
    transformers is needed to export."""
    run, _, first = bpe_export
    assert [p.name for p in first.parent.iterdir()] == ["gpt2"]  # no temp dir left beside it

    out = tmp_path / "empty"
    out.mkdir()
    blocked = cli("export", str(run), "--out", str(out), env=_without_torch(tmp_path))
    assert blocked.returncode == 0, f"export needs torch or transformers: {blocked.stderr[-2000:]}"
    assert export_hashes(out) == export_hashes(first)  # into an empty --out; the same bytes as the first export

    before = tree_bytes(out)
    p = cli("export", str(run), "--out", str(out))  # now non-empty: refused, no byte of it overwritten
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert (
        p.stderr == f"error: --out {out} exists and is not an empty directory; pick a new one (nothing was written)\n"
    )
    assert tree_bytes(out) == before

    (tmp_path / "afile").write_text("")
    p = cli("export", str(run), "--out", str(tmp_path / "afile" / "sub" / "tiny"))
    assert p.returncode == 2 and p.stderr == (
        f"error: --out {tmp_path / 'afile' / 'sub' / 'tiny'}: {tmp_path / 'afile'} is not a writable directory; "
        "pick another --out\n"
    ), p.stderr

    p = cli("export", str(tmp_path / "no-such-run"), "--out", str(tmp_path / "unmade" / "tiny"))
    assert p.returncode == 2 and p.stderr.startswith("error: ") and p.stderr.count("\n") == 1, p.stderr
    assert not (tmp_path / "unmade").exists()


def test_transformers_gpt2lmheadmodel_loads_the_export(exported, bpe_export, monkeypatch):
    """Skipped where torch and transformers are not installed, except under CI, which installs them."""
    torch, transformers = need_transformers()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a local directory: nothing is ever fetched

    run, out = exported
    model = transformers.GPT2LMHeadModel.from_pretrained(str(out)).eval()
    ids = list(TEXT[-64:])
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].numpy()
    diff = float(np.abs(trainer_logits(run, ids) - theirs).max())
    print(f"logits max abs diff, trainer vs transformers {transformers.__version__} GPT2LMHeadModel: {diff:.2e}")
    assert diff < 1e-4
    from tokenizers import Tokenizer

    _, prepared, bpe = bpe_export  # the exported tokenizer loads as a fast tokenizer and encodes as ours does
    ours = Tokenizer.from_file(str(prepared / "tokenizer.json")).encode("the data step").ids
    assert transformers.AutoTokenizer.from_pretrained(str(bpe))("the data step")["input_ids"] == ours


# --- 2: the sharding a checkpoint was saved with does not change the export ----------------------------

SHARDED_RESTORE = """
import hashlib, json, sys
from pathlib import Path
from trainer.config import Config, MeshConfig
from trainer.ckpt import checkpoint
from trainer.store import ckpt_files as files
from trainer.model import hf
from trainer.train import optim, state
from trainer.parallel.mesh import make_mesh
from trainer.model.model import GPT
from trainer.yamltree import build

out = {}
for run in sys.argv[1:]:
    step_dir = max((Path(run) / "checkpoints").glob("[0-9]*"), key=lambda p: int(p.name))
    meta = files.read_meta(step_dir)
    cfg = build(Config, meta.record["config"], "")
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    tx = optim.make_optimizer(cfg.optim, cfg.model)
    spec = state.build(GPT(cfg.model), tx, mesh, seed=cfg.run.seed, seq_len=cfg.model.seq_len)
    # the trainer's own resume: every array sharded over the mesh
    st = checkpoint.Checkpointer(Path(run) / "checkpoints", cfg.checkpoint, read_only=True).restore(
        int(step_dir.name), spec.abstract, meta=lambda: meta).state
    assert len(st["params"]["wte"].sharding.device_set) == 8
    tensors = hf.tensors(st["params"], cfg.model)
    out[run] = {k: hashlib.sha256(v.tobytes()).hexdigest() for k, v in tensors.items()}
print(json.dumps(out))
"""


def test_export_does_not_depend_on_the_mesh_or_process_count_that_saved(exported, fine_tuned, tmp_path):
    runs = {"1 process x 4 devices": fine_tuned, "2 processes x 2 devices": exported[0]}  # both 2 x 2 x 1
    flags = "--xla_force_host_platform_device_count=8"
    env = dict(child_env(), JAX_PLATFORMS="cpu", XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}")
    p = subprocess.run(
        [sys.executable, "-c", SHARDED_RESTORE, *map(str, runs.values())],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    sharded = json.loads(p.stdout.splitlines()[-1])
    for name, run in runs.items():
        state = run / "checkpoints" / str(newest(run)) / "state"
        shards = sorted(x.name for x in state.glob("ocdbt.process_*"))
        out = exported[1] if run == exported[0] else tmp_path / "gpt2"
        got = export_hashes(out) if out.exists() else export(run, out)  # one CPU device, no mesh
        meta = got.pop("__meta__")
        # The one-device restore holds the exact params the run trained (its own hash, taken on its mesh) ...
        assert meta["trainer_params_sha256"] == summary(run)["params_sha256"]
        # ... and exports the tensors of the trainer's own sharded restore of the same checkpoint, bit for bit.
        assert got == sharded[str(run)] and len(got) == 4 + 12 * 2
        print(
            f"{name} ({', '.join(shards)}): {len(got)} tensors equal by sha256 between the one-device export and "
            f"the 8-device sharded restore; params_sha256 {meta['trainer_params_sha256'][:16]} = summary.json's"
        )


def test_exports_of_one_checkpoint_are_the_same_bytes(exported, tmp_path):
    """safetensors orders the header's metadata anew in each process (5 keys: 120 orders); the export sorts it,
    so every export of a checkpoint is the same file."""
    run, first = exported
    for i in range(2):  # each in its own process: with the order left to safetensors, equal 1 time in 14,400
        export(run, tmp_path / str(i))
        for f in sorted(p.name for p in first.iterdir()):
            assert (tmp_path / str(i) / f).read_bytes() == (first / f).read_bytes(), f


def test_export_verifies_first_a_damaged_checkpoint_is_skipped_or_refused(fine_tuned, tmp_path):
    run = tmp_path / "copy"
    shutil.copytree(fine_tuned, run)
    victim = max(
        (p for p in (run / "checkpoints" / "8" / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    p = cli("export", str(run), "--out", str(tmp_path / "named"), "--step", "8")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and not (tmp_path / "named").exists(), p.stderr
    assert p.stderr.startswith(f"error: checkpoint {run}/checkpoints/8 does not verify: content checksum mismatch")
    p = cli("export", str(run), "--out", str(tmp_path / "newest"))
    assert p.returncode == 0 and "note: step 8 skipped: content checksum mismatch" in p.stderr, p.stderr
    assert export_hashes(tmp_path / "newest")["__meta__"]["trainer_step"] == "6"


# --- 3: train.init_from ---------------------------------------------------------------------------------


def test_init_from_a_finished_run_live_export_and_bitwise_resume(group, fine_tuned, tmp_path):
    from trainer.ckpt import weights

    source, corpus = group
    first, old_last, fresh_first = step_losses(fine_tuned)[1][0], step_losses(source)[30][0], step_losses(source)[1][0]
    print(
        f"init_from: first loss {first:.4f}; the source run's last {old_last:.4f}; a fresh start's first "
        f"{fresh_first:.4f}"
    )
    assert abs(first - old_last) < 0.25 * abs(fresh_first - old_last)
    init = [e for e in events(fine_tuned) if e["event"] == E.INIT_FROM]
    assert len(init) == 1 and init[0]["from_step"] == 30 and init[0]["verified"]
    assert weights.read_meta(fine_tuned / "checkpoints" / "8")["init_from"]["checkpoint"] == str(
        source / "checkpoints" / "30"
    )

    # The same fine-tuning hangs at step 4 while live: export refuses its newest checkpoint and takes a named,
    # sealed one; then the run is killed and resumed from its own checkpoint (init_from is not applied again).
    run = tmp_path / "killed"
    overrides = group_overrides(corpus, *ONE, *FINE_TUNE, f"train.init_from={source}")
    with open(tmp_path / "worker.log", "w") as log:
        worker = subprocess.Popen(
            trainer_cmd(run, *overrides, "faults=[{kind: hang, step: 4}]", worker=True),
            cwd=ROOT,
            env=child_env(),
            stdout=log,
            stderr=log,
        )
    try:
        hb = run / "heartbeat" / "worker-0.json"
        wait_for(
            lambda: (
                worker.poll() is None
                and hb.is_file()
                and json.loads(hb.read_text())["step"] == 4
                and (run / "checkpoints" / "3" / "integrity" / "process_0.json").is_file()
            ),
            240,
            "the hang at step 4",
        )
        refused = cli("export", str(run), "--out", str(tmp_path / "live"))
        assert refused.returncode == 2 and not (tmp_path / "live").exists()
        assert refused.stderr.startswith("error: ") and refused.stderr.count("\n") == 1, refused.stderr
        assert f"still training (pid {worker.pid})" in refused.stderr and refused.stderr.rstrip().endswith(": 3")
        assert export(run, tmp_path / "live", "--step", "3")["__meta__"]["trainer_step"] == "3"
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    run_trainer(run, *overrides, worker=True)
    assert [e["event"] for e in events(run)].count(E.INIT_FROM) == 1
    assert [e["step"] for e in events(run) if e["event"] == E.RESTORE] == [3]
    assert summary(run)["params_sha256"] == summary(fine_tuned)["params_sha256"]
    assert {k: v[-1] for k, v in step_losses(run).items()} == {k: v[0] for k, v in step_losses(fine_tuned).items()}


def test_init_from_a_step_dir_takes_that_checkpoints_params(group):
    """README: train.init_from=RUN_DIR/checkpoints/STEP starts from that checkpoint, not the run's newest: the
    resolution a worker start makes (weights.init_source) and the params it then restores (init_params)."""
    import jax

    from trainer.ckpt import weights
    from trainer.config import load_config
    from trainer.observe import pick
    from trainer.train.state import params_sha256

    source, corpus = group
    older = min(pick.steps(source))
    assert older < newest(source) == 30, pick.steps(source)
    step_dir = source / "checkpoints" / str(older)
    cfg = load_config(TINY, [*MICRO, *group_overrides(corpus, *ONE, f"train.init_from={step_dir}")])
    src = weights.init_source(cfg)
    assert src["from_step"] == older and src["checkpoint"] == str(step_dir.absolute()) and src["verified"], src
    device = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), weights.abstract_params(cfg.model)
    )
    got = params_sha256(weights.init_params(src, cfg.model, target))
    assert got == params_sha256(weights.on_cpu(pick.pick(source, older)).params) != summary(source)["params_sha256"]


def test_init_from_with_other_shapes_is_one_line_and_writes_nothing(group, tmp_path):
    source, corpus = group
    run = tmp_path / "run"
    p = run_trainer(run, *group_overrides(corpus, *ONE, "model.d_ff=512", f"train.init_from={source}"), check=False)
    assert p.returncode == 2 and not run.exists(), p.stderr
    assert p.stderr == (
        f"error: train.init_from: param blocks/fc/bias: shape [2, 512] in this run's model, shape "
        f"[2, 256] in {source}/checkpoints/30; set the model keys as that run had them\n"
    )
