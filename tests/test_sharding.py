"""The compiled step is what the sharding plan says, measured from XLA's own after-optimizations dump of
the tiny config's train step on 8 fake devices: FSDP moves at most 1.5 x its ideal (gather the params
forward and backward, reduce the gradients: 3 x the data-parallel gradient all-reduce), no mesh makes the
partitioner fall back to "involuntary full rematerialization", FSDP needs less temporary memory than data
parallelism, and `inspect` reports exactly the collective bytes and matmul FLOPs of the dump."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, TINY, child_env, sets

from trainer.tools import hlo

MESHES = {
    "data8": ["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1"],
    "fsdp8": ["mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1"],
    "2x2x2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
}
REMAT_WARNING = "Involuntary full rematerialization"

# A loop body that runs 3 times: one all-gather (result 8x4 f32 = 128 B) and one all-reduce (operand
# 16 bf16 = 32 B) per iteration over groups {0,1},{2,3}; one cross-host all-reduce after it (4 f32 = 16 B).
HLO = """HloModule m, is_scheduled=true

%body (p: (s32[], f32[2,4])) -> (s32[], f32[2,4]) {
  %p = (s32[], f32[2,4]{1,0}) parameter(0)
  %x = f32[2,4]{1,0} get-tuple-element(%p), index=1
  %ag = f32[8,4]{1,0} all-gather(%x), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  %h = bf16[16]{0} bitcast(%ag)
  %ar = bf16[16]{0} all-reduce(%h), channel_id=2, replica_groups=[2,2]<=[4], to_apply=%add
  %w = f32[4,4]{1,0} parameter(1)
  %d = f32[2,4]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (s32[], f32[2,4]{1,0}) tuple(%i, %d)
}

%cond (q: (s32[], f32[2,4])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[2,4]) -> f32[4] {
  %a = f32[2,4]{1,0} parameter(0)
  %wl = (s32[], f32[2,4]{1,0}) while(%tup), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %v = f32[4]{0} bitcast(%a)
  ROOT %r = f32[4]{0} all-reduce(%v), channel_id=3, replica_groups={{0,2},{1,3}}, to_apply=%add
}
"""


def test_hlo_counts_loop_bodies_by_trip_count_and_finds_cross_host_groups():
    s = hlo.analyze(HLO, host_size=2)
    assert s.collective_bytes["all-gather"] == 3 * 128 and s.collective_ops["all-gather"] == 3
    assert s.collective_bytes["all-reduce"] == 3 * 32 + 16 and s.collective_ops["all-reduce"] == 4
    assert s.matmul_flops == 3 * 2 * 2 * 4 * 4
    # {0,1,2,3} spans hosts {0,1} and {2,3}; [2,2]<=[4] is {0,1},{2,3}: one host each; {0,2} spans two.
    assert s.inter_host_bytes == 3 * 128 + 16
    assert hlo.groups("replica_groups=[4,2]<=[2,2,2]T(1,0,2)") == [[0, 1], [4, 5], [2, 3], [6, 7]]
    mesh = "replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}"
    assert hlo.groups(mesh) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # ids [[0, 4], [1, 5], ...]: axis_1 runs down


def test_the_models_logical_constraints_take_effect_under_the_mesh():
    """jax.set_mesh sets the abstract mesh, which flax reads from 0.11.2 on: with an older flax every
    nn.with_logical_constraint in the model silently vanishes (and propagation guesses the shardings)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    from trainer.parallel.mesh import AXES, active

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), AXES)
    with active(mesh):
        jaxpr = jax.make_jaxpr(lambda x: nn.with_logical_constraint(x, ("batch", "act_embed")))(jnp.ones((2, 4)))
    assert "sharding_constraint" in str(jaxpr), jaxpr


def _inspect_with_dump(mesh: str, dump: Path) -> subprocess.Popen:
    flags = f"--xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_train_step"
    # Added to the suite's XLA flags (its cheaper LLVM back end; the HLO passes this test reads are unchanged)
    env = child_env()
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}".strip()
    cmd = [sys.executable, "-m", "trainer", "inspect", "--config", TINY, *sets(*MESHES[mesh]), "--json"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_compiled_step_moves_what_the_plan_says(tmp_path):
    procs = {m: _inspect_with_dump(m, tmp_path / m) for m in MESHES}
    dumped, reported = {}, {}
    for mesh, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        assert REMAT_WARNING not in err, f"{mesh}: {err[-3000:]}"
        (path,) = (tmp_path / mesh).glob("*jit_train_step*after_optimizations.txt")
        dumped[mesh] = hlo.analyze(path.read_text())
        reported[mesh] = json.loads(out)
    grad_bytes = dumped["data8"].collective_bytes["all-reduce"]
    assert dumped["data8"].total_collective_bytes == grad_bytes  # data parallel: one gradient all-reduce
    budget = 1.5 * 3 * grad_bytes
    print({m: s.total_collective_bytes for m, s in dumped.items()}, f"budget {budget:.0f}")
    assert dumped["fsdp8"].total_collective_bytes <= budget
    for mesh, s in dumped.items():  # inspect reads the compiled executable, the dump is its text: the same numbers
        got = reported[mesh]
        assert (got["collective_bytes_total"], got["collective_bytes_per_step"], got["collective_ops_per_step"]) == (
            s.total_collective_bytes,
            s.collective_bytes,
            s.collective_ops,
        ), (mesh, got, s)
        assert got["flops_per_device_per_step"]["compiled_matmul"] == s.matmul_flops, (mesh, got, s)
    temp = {m: r["bytes_per_device"]["temp"] for m, r in reported.items()}
    print("temp bytes per device", temp)
    assert temp["fsdp8"] < temp["data8"]


# Attention-heavy on one device (L = 256 against D = 64), so the whole L x L that the loop's MFU counted before
# (its mfu_full_attn) exceeds what the compiled step computes: the old "model FLOPs / compiled matmuls" ceiling
# read ~116% here.
LONG = ["model.seq_len=256", "model.d_model=64", "model.n_heads=4", "model.n_layers=2", "data.batch_size=4"]
ONE_DEVICE = ["mesh.cpu_devices=1", "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]


def test_inspect_mfu_ceiling_counts_useful_flops_and_cannot_pass_100_percent():
    from trainer.tools.inspect import render

    cmd = [sys.executable, "-m", "trainer", "inspect", "--config", TINY, *sets(*LONG, *ONE_DEVICE), "--gpu", "H200"]
    p = subprocess.run([*cmd, "--json"], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    f, ceiling = r["flops_per_device_per_step"], r["mfu_ceiling"]
    print(f"flops {f}; ceiling {ceiling}; old model/compiled {f['model_full_attn'] / f['compiled_matmul']:.3f}")
    assert 0.5 < ceiling["serial"] <= ceiling["compute"] <= 1.0
    assert f["model_full_attn"] > f["compiled_matmul"]  # the case the old definition read above 100%
    # useful = 6 x the params in matmuls (12 D^2 a layer, and the tied head V x D) plus QK^T and PV, forward
    # and backward, for the causal half: 6 x layers x D x L a token, the loop's MFU's own attention term.
    D, L, V, layers, tokens = 64, 256, 384, 2, 4 * 256
    assert f["useful"] == (6 * (layers * 12 * D * D + V * D) + 6 * layers * D * L) * tokens
    assert f["model_full_attn"] - f["model"] == 6 * layers * D * L * tokens
    assert f["attention_kernel"] == 0 and ceiling["compute"] == f["useful"] / f["compiled_matmul"]
    assert sum(r["matmul_flops_by_operand_dtypes"].values()) == pytest.approx(f["compiled_matmul"])
    # The head's matmuls carry the vocabulary: the logits and both their gradients (a loss that fuses the
    # head may compute the logits inside the backward pass); this config computes in f32, so none is bf16.
    phases = [m["phase"] for m in r["vocab_matmuls"]]
    assert r["vocab_dims"] == [V] and len(phases) >= 3 and "backward" in phases, r["vocab_matmuls"]
    assert r["vocab_matmuls_bf16"] is False and all("f32[" in m["operands"][0] for m in r["vocab_matmuls"])
    text = render(r)
    line = next(x for x in text.splitlines() if x.startswith("MFU ceiling on H200"))
    assert "at most 100%" in line and f"x{f['model'] / f['useful']:.3f}" in line, line
    assert "matmuls with the vocabulary (a dim of 384): all bf16 operands: NO" in text, text


@pytest.mark.parametrize("kv, tensor, sharded", [(2, 2, True), (4, 2, True), (1, 2, False), (2, 4, False)])
def test_kv_heads_shard_over_tensor_where_they_divide_else_replicate(kv, tensor, sharded):
    """The one logical-axis table places GQA's K/V heads: over the tensor axis when n_kv_heads divides it,
    replicated otherwise (the query heads, which must divide, stay sharded either way)."""
    import flax.linen as nn
    from jax.sharding import AbstractMesh, PartitionSpec

    from trainer.config import ModelConfig
    from trainer.parallel.mesh import AXES, kv_replicated, rules

    mesh = AbstractMesh((1, 1, tensor), AXES)
    cfg = ModelConfig(arch="llama", n_heads=8, n_kv_heads=kv, d_model=128)
    table = rules(mesh, cfg)
    kv_spec = nn.logical_to_mesh_axes(("layers", "embed", None, "kv_heads", "head_dim"), table)
    q_spec = nn.logical_to_mesh_axes(("layers", "embed", "heads", "head_dim"), table)
    assert kv_spec == PartitionSpec(None, "fsdp", None, "tensor" if sharded else None, None)
    assert q_spec == PartitionSpec(None, "fsdp", "tensor", None)
    assert kv_replicated(cfg, tensor) == (not sharded)


def test_a_tensor_group_across_processes_is_refused_with_the_fix():
    """Each process feeds its own rows of the batch, and a tensor-parallel group holds replicas of the same rows:
    a group that spans processes got rows of two batches (a crash loop of "compiled with int32[16,65] and called
    with int32[8,65]" at 8 processes of one device each). Refused before anything runs, naming the key."""
    from trainer.config import ConfigError, load_config
    from trainer.train.worker import validate_shapes

    cfg = load_config(TINY, ["launch.processes=8", "mesh.cpu_devices=1"])
    with pytest.raises(ConfigError, match=r"mesh.tensor \(2\) spans processes \(1 devices per process\).*divisor of 1"):
        validate_shapes(cfg, (2, 2, 2), 8, 1, None)
    validate_shapes(cfg, (4, 2, 1), 8, 1, None)  # tensor 1: every process its own rows
    validate_shapes(cfg, (2, 2, 2), 4, 1, None)  # 2 devices per process: the tensor pair inside each
