"""The Llama family end to end: a micro Llama (rotary positions, RMSNorm, SwiGLU, 2 K/V heads for 4 query heads,
untied head, no biases, z-loss, dropout so the saved PRNG key matters) trains, and a SIGKILLed supervised run
ends with the bytes of an uninterrupted one; multi-query and multi-head variants train too; `export` writes
what transformers' LlamaForCausalLM computes, `sample` decodes as it does; a transformers-made Llama (and
GPT-2) directory read through `train.init_from` exports back bit for bit, and a mismatched one is refused."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, child_env, events, need_transformers, run_trainer, step_losses, summary
from safetensors.numpy import load_file

from trainer.store import event_names as E

pytestmark = pytest.mark.slow  # every test here trains end to end (fast loop: -m 'not slow')

# on top of conftest.MICRO (d_model 64, 2 layers, 4 heads, seq 64, 30 steps, tiny.yaml's 2 x 2 x 2 mesh)
LLAMA = ["model.arch=llama", "model.n_kv_heads=2", "model.dropout=0.1", "train.z_loss=1e-4"]
KILL = "faults=[{kind: signal, signal: SIGKILL, step: 23}]"


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer", *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env=child_env()
    )


def test_a_sigkilled_llama_resumes_bit_for_bit_and_its_loss_falls(tmp_path, reference_run):
    ref = reference_run(*LLAMA)
    losses = step_losses(ref)
    assert losses[30][0] < losses[1][0] - 1.0, (losses[1], losses[30])  # ~5.9 -> ~3.4
    run = tmp_path / "run"
    run_trainer(run, *LLAMA, KILL)  # supervised: the worker is SIGKILLed at step 23 and restarted
    exits = [e for e in events(run) if e["event"] == E.WORKER_EXIT]
    assert [e.get("signal") for e in exits] == ["SIGKILL", None], exits
    # resumed from a checkpoint (10, or 20 when its async save had committed), not restarted from 0
    assert [e["step"] for e in events(run) if e["event"] == E.RESTORE] in ([10], [20])
    assert summary(run)["params_sha256"] == summary(ref)["params_sha256"]
    resumed = step_losses(run)
    assert sorted(resumed) == list(range(1, 31))
    assert all(set(v) == {losses[s][0]} for s, v in resumed.items())  # recomputed steps log the same bits
    assert summary(run)["restarts"] == 1


@pytest.mark.parametrize("kv", [1, 4])
def test_multi_query_and_multi_head_llamas_train(tmp_path, kv):
    """kv 1: one K/V head, which does not divide mesh.tensor=2, so it is replicated (and the run says so);
    kv 4 = n_heads: the fused qkv projection, as GPT-2's."""
    run = tmp_path / "run"
    p = run_trainer(run, "model.arch=llama", f"model.n_kv_heads={kv}", "train.steps=12", worker=True)
    replicated = "K/V projections are replicated over the tensor axis" in p.stderr
    assert replicated == (kv == 1), p.stderr[-2000:]
    losses = step_losses(run)
    assert losses[12][0] < losses[1][0] - 0.5, (losses[1], losses[12])


@pytest.fixture(scope="module")
def exported_llama(tmp_path_factory, reference_run) -> tuple:
    run = reference_run(*LLAMA)
    out = tmp_path_factory.mktemp("export") / "llama"
    p = cli("export", str(run), "--out", str(out))
    assert p.returncode == 0, p.stderr
    return run, out


def test_export_is_what_transformers_llama_computes(exported_llama, monkeypatch):
    torch, transformers = need_transformers()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from test_export import trainer_logits

    run, out = exported_llama
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_key_value_heads"] == 2
    assert (cfg["num_attention_heads"], cfg["rope_theta"], cfg["rms_norm_eps"], cfg["tie_word_embeddings"]) == (
        4,
        10000.0,
        1e-5,
        False,
    )
    model = transformers.LlamaForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    ids = list(np.random.default_rng(0).integers(0, 384, 64))
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].numpy()
    diff = float(np.abs(trainer_logits(run, ids) - theirs).max())
    print(f"logits max abs diff, trainer vs transformers {transformers.__version__} LlamaForCausalLM: {diff:.2e}")
    assert diff <= 1e-4


def _hf_model(family: str, transformers, path):
    """A randomly initialised transformers model of conftest.MICRO's sizes, saved with save_pretrained."""
    import torch

    torch.manual_seed(0)
    if family == "llama":
        config = transformers.LlamaConfig(
            vocab_size=384,
            hidden_size=64,
            intermediate_size=192,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            tie_word_embeddings=False,
        )
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPT2Config(vocab_size=384, n_positions=128, n_embd=64, n_layer=2, n_head=4)
        model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():  # norms off 1 and biases off 0: every tensor's placement matters
        for t in model.parameters():
            if t.dim() == 1:
                t.add_(0.1 * torch.randn_like(t))
    model.save_pretrained(str(path))
    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_transformers_directory_as_init_from_exports_back_bit_for_bit(tmp_path, family, monkeypatch):
    """One step at lr 0 (warmup) keeps the params: the checkpoint holds the directory's tensors as read in.
    GPT-2's 128 learned positions are cut to the run's seq_len 64 (fine-tuning at a shorter context)."""
    torch, transformers = need_transformers()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    saved = _hf_model(family, transformers, tmp_path / "hf")
    arch = ["model.arch=llama", "model.n_kv_heads=2", "model.d_ff=192"] if family == "llama" else []
    run = tmp_path / "run"
    steps = ["train.steps=4", "optim.warmup_steps=2", "train.stop_at_step=1"]  # lr(step 1) = 0: saved, stopped
    run_trainer(run, *arch, *steps, f"train.init_from={tmp_path / 'hf'}", worker=True)
    start = next(e for e in events(run) if e["event"] == E.INIT_FROM)
    assert start["format"] == f"huggingface {family}"
    p = cli("export", str(run), "--out", str(tmp_path / "out"))
    assert p.returncode == 0, p.stderr
    back = load_file(str(tmp_path / "out" / "model.safetensors"))
    if family == "gpt2":  # positions beyond the run's seq_len are not in the model
        saved["transformer.wpe.weight"] = saved["transformer.wpe.weight"][:64]
        saved = {k: v for k, v in saved.items() if not k.endswith(".attn.bias")}  # old GPT-2 mask buffers
    assert sorted(back) == sorted(saved)
    same = [k for k in saved if back[k].dtype == saved[k].dtype and back[k].tobytes() == saved[k].tobytes()]
    assert len(same) == len(saved), sorted(set(saved) - set(same))
    print(f"{family}: {len(same)} tensors bitwise equal after init_from -> 1 step at lr 0 -> export")
    if family == "llama":  # random weights decode varied tokens (a 30-step model repeats one)
        _sample_decodes_as_transformers(run, tmp_path / "hf", torch, transformers)


def _sample_decodes_as_transformers(run, hf_dir, torch, transformers) -> None:
    """`sample` at temperature 0 (its crop, its end-of-text stop) against transformers' greedy argmax."""
    prompt = "the step of the"
    p = cli("sample", str(run), "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "12", "--json")
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    ids = list(prompt.encode())
    assert got["prompt_ids"] == ids
    model = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir), torch_dtype=torch.float32).eval()
    want = []
    for _ in range(12):
        with torch.no_grad():
            want.append(int(model(torch.tensor([ids + want])).logits[0, -1].argmax()))
        if want[-1] == 256:
            break
    print(f"greedy: sample {got['new_ids']} == transformers {want}")
    assert got["new_ids"] == want and len(set(want)) > 1


def test_a_directory_that_does_not_match_the_model_keys_is_refused(tmp_path, monkeypatch):
    torch, transformers = need_transformers()
    _hf_model("llama", transformers, tmp_path / "hf")
    run = tmp_path / "run"
    p = run_trainer(
        run, "model.arch=llama", "model.n_kv_heads=4", f"train.init_from={tmp_path / 'hf'}", worker=True, check=False
    )
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr[-2000:]
    assert "has model.n_kv_heads=2, this run's model has 4; set model.n_kv_heads=2" in p.stderr
    assert not (run / "checkpoints").exists()
