"""`python -m trainer inspect --config FILE [--set k=v ...] [--json]`: size a run before spending GPU-hours.

Compiles the config's train step for its mesh without training or allocating the state, and reports per
device what XLA's compiled executable says: state bytes, temporary (activation) bytes from its memory
analysis, collective bytes per step by kind and matmul FLOPs from its optimized HLO (trainer.tools.hlo:
dots and, on a GPU, cuBLAS custom calls), the operand dtypes of the matmuls that carry the vocabulary, and
an MFU ceiling for a GPU. Without enough GPUs here it compiles on fake CPU devices of the mesh's size.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

from trainer.config import Config, ConfigError, load_config

GIB = 1 << 30
# name: dense bf16 peak FLOP/s, memory bytes, NVLink bytes/s per GPU per direction, network bytes/s per GPU.
GPUS = {
    "H100": (989e12, 80 * GIB, 450e9, 50e9),
    "H200": (989e12, 141 * GIB, 450e9, 50e9),
    "A100": (312e12, 80 * GIB, 300e9, 25e9),
}
HOST_GPUS = 8  # devices per host: collectives whose groups span hosts are priced at the network's bandwidth
MEM_FRACTION = 0.90  # of device memory XLA may use (the multi-GPU configs' run.gpu_mem_fraction: trainer.xla_env)

HELP = """MFU ceilings (peak = the GPU's dense bf16 figure). They count "useful" FLOPs: 6 per token for each
param that enters a matmul (the kernels and the LM head; not norms, biases or the position table) plus
attention's causal half (6 x layers x D x L a token, L/2 keys per query on average, as llm.c and MaxText
count: trainer.model.model.attention_flops_per_token, the loop's MFU's own term), no more than any exact
causal step computes. "compute" = useful FLOPs / the step's matmul FLOPs (the compiled HLO's dots and cuBLAS
calls, plus the useful attention FLOPs when cuDNN's fused kernel runs it, a kernel being no matmul in the
HLO): the MFU if every matmul ran at peak and nothing else took time. It cannot pass 100%; remat recompute
and attention work the mask throws away lower it (XLA's path computes the blocks on and below the diagonal,
5/8 of L x L). "serial" also adds the collectives' time at the link's bandwidth (NVLink inside a host of 8,
the network for groups that span hosts; all-reduce counted twice, as a ring moves it) as if none overlapped
with compute.
The MFU the training loop logs (`mfu`) is 6 x params plus the same causal half: the same step at the same
speed reads "model / useful" times this scale (a little above 1: norms and biases count as params there).
Its `mfu_full_attn` is the figure logged before, the whole L x L as nanoGPT and PaLM count it (FLOPs
"model_full_attn"): it can read above these ceilings, even above 100% (the L x L counts about 3/8 more
attention work than XLA's blocked path and twice the causal half).
Vocabulary matmuls: every matmul with an operand dimension of the vocabulary's size (or of its shard over
the tensor axis), with its operand dtypes and its pass (forward / backward, from jax's op names in the HLO;
remat's recompute reads forward); "vocab_matmuls_bf16" says whether all of them take bf16 operands (null
when none is found, e.g. a loss that chunks the vocabulary). Operand dtypes (here and by FLOPs) are the
program's: XLA:CPU runs a bf16 x bf16 -> bf16 dot as an f32 dot between converts it adds itself (those
without jax's op metadata; it keeps a bf16 x bf16 -> f32 dot), a GPU keeps it in bf16, so the dtypes are
read from before those converts ("upcast_by_xla" marks such a matmul).
A real step lands below both ceilings: elementwise work, attention kernels and launch gaps are not counted.
On fake CPU devices the memory figures are the CPU compiler's: attention there materialises the scores
(the blocks on and below the diagonal, 5/8 of L x L; cuDNN's fused kernel keeps none), so temp bytes are
an upper bound for a GPU."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer inspect",
        description=__doc__.splitlines()[0],
        epilog=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="YAML file of differences from the defaults")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.add_argument("--gpu", default="H100", choices=sorted(GPUS), help="GPU to price memory and MFU for")
    p.add_argument(
        "--devices",
        type=int,
        default=0,
        help="device count (default: the mesh's; with mesh.data=-1, data = launch.processes)",
    )
    return p


def device_count(cfg: Config, devices: int) -> int:
    if devices:
        return devices
    if cfg.mesh.cpu_devices:
        return cfg.mesh.cpu_devices * cfg.launch.processes
    data = cfg.mesh.data if cfg.mesh.data > 0 else cfg.launch.processes
    return data * cfg.mesh.fsdp * cfg.mesh.tensor


def _devices(n: int):
    """n devices of this machine's accelerator if it has them, else n fake CPU devices."""
    import jax

    jax.config.update("jax_num_cpu_devices", n)  # before any backend starts; harmless for a GPU
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if len(gpus) >= n:
        return gpus[:n], f"{n} x {gpus[0].device_kind}"
    jax.config.update("jax_platforms", "cpu")
    return jax.devices("cpu")[:n], f"{n} fake CPU devices (abstract compile; no GPU here)"


def _stand_in(cfg: Config, devices: list) -> tuple[Config, str]:
    """On CPU devices a run that would use cuDNN's fused attention compiles XLA's path with the scores
    recomputed in the backward pass: no kernel, but the kernel's memory profile."""
    from trainer.model.model import attention_impl

    on_gpu = attention_impl(cfg.model, "gpu")
    if devices[0].platform == "gpu" or on_gpu != "cudnn":
        return cfg, attention_impl(cfg.model, devices[0].platform)
    model = dataclasses.replace(cfg.model, attention="xla_remat")
    return dataclasses.replace(cfg, model=model), "xla_remat (stand-in for cudnn on CPU)"


def _shard_bytes(tree) -> int:
    import jax

    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def compile_for(cfg: Config, devices: list):
    """(state spec, mesh, compiled step) for the config on these devices."""
    import numpy as np
    from jax.sharding import Mesh

    from trainer.parallel import mesh as mesh_lib
    from trainer.train.step import lower_train_step
    from trainer.train.worker import state_spec, validate_shapes

    shape = mesh_lib.mesh_shape(cfg.mesh, len(devices))
    validate_shapes(cfg, shape, cfg.launch.processes, cfg.train.microbatches, None)
    mesh = Mesh(np.array(devices).reshape(shape), mesh_lib.AXES)
    spec = state_spec(cfg, mesh)
    return spec, mesh, lower_train_step(spec, mesh, cfg, microbatches=cfg.train.microbatches).compile()


def measure(cfg: Config, devices: list, gpu: str) -> dict:
    from trainer.model.model import attention_impl, flops_per_token
    from trainer.tools import hlo
    from trainer.train.state import param_count

    spec, mesh, compiled = compile_for(cfg, devices)
    n = len(devices)
    mem = compiled.memory_analysis()
    stats = hlo.analyze(compiled.as_text(), host_size=HOST_GPUS)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost  # older jax returned one dict per program
    tokens_per_device = cfg.data.batch_size * cfg.model.seq_len / n
    model_flops = flops_per_token(cfg.model, param_count(spec.abstract)) * tokens_per_device
    model_full_attn = flops_per_token(cfg.model, param_count(spec.abstract), causal=False) * tokens_per_device
    useful = useful_flops_per_token(cfg, spec.abstract["params"])
    useful_flops = (useful.matmul_params + useful.attention) * tokens_per_device
    # cuDNN's fused attention is a custom call, not a dot in the HLO: its work joins the step's matmul FLOPs
    # at the causal half, the least it can do, so the useful FLOPs never exceed what the step computes.
    kernel_flops = (
        useful.attention * tokens_per_device if attention_impl(cfg.model, devices[0].platform) == "cudnn" else 0.0
    )
    peak_bytes = (
        mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
    )
    return {
        "mesh": dict(zip(mesh.axis_names, mesh.devices.shape)),
        "devices": n,
        "n_params": param_count(spec.abstract),
        "microbatches": cfg.train.microbatches,
        "sequences_per_device": cfg.data.batch_size // (n // cfg.mesh.tensor),
        "bytes_per_device": {
            "params": _shard_bytes(spec.abstract["params"]),
            "optimizer": _shard_bytes(spec.abstract["opt_state"]),
            "arguments": mem.argument_size_in_bytes,
            "temp": mem.temp_size_in_bytes,
            "outputs_not_aliased": mem.output_size_in_bytes - mem.alias_size_in_bytes,
            "peak": peak_bytes,
        },
        "collective_bytes_per_step": stats.collective_bytes,
        "collective_ops_per_step": stats.collective_ops,
        "collective_bytes_total": stats.total_collective_bytes,
        "collective_bytes_inter_host": stats.inter_host_bytes,
        "flops_per_device_per_step": {
            "model": model_flops,  # the training loop's `mfu`: 6 x params + attention's causal half
            "model_full_attn": model_full_attn,  # its `mfu_full_attn`: the whole L x L (the figure before)
            "useful": useful_flops,  # the ceilings' numerator: matmul params and attention's causal half
            "compiled_matmul": stats.matmul_flops,
            "attention_kernel": kernel_flops,  # cuDNN's fused attention at the causal half; 0 when XLA's path
            "xla_cost_analysis": float(cost.get("flops", 0.0)),  # counts each loop body once
        },
        "matmul_flops_by_operand_dtypes": stats.matmul_flops_by_dtypes(),
        "attention_custom_calls": stats.attention_calls,  # cuDNN fused attention: target -> executions per step
        **vocab_matmuls(stats.matmuls, vocab_dims(cfg)),
        "unknown_loop_trip_counts": stats.unknown_trip_counts,
        **_ceiling(gpu, useful_flops, stats.matmul_flops + kernel_flops, stats, peak_bytes),
    }


@dataclasses.dataclass(frozen=True)
class UsefulFlops:
    """Training FLOPs per token that any exact step must compute (the MFU ceilings' numerator)."""

    matmul_params: float  # 6 x the params that enter a matmul: forward, input gradient, weight gradient
    attention: float  # QK^T and PV, forward and backward, for the causal half of L x L (L/2 keys a query)


def vocab_dims(cfg: Config) -> list[int]:
    """The sizes the vocabulary dimension takes in the per-device HLO: whole, or its shard over the tensor
    axis (the logical rules put "vocab" on it), unless that shard size is also the model's width."""
    v, t = cfg.model.vocab_size, cfg.mesh.tensor
    shard = v // t if t > 1 and v % t == 0 and v // t not in (cfg.model.d_model, cfg.model.seq_len) else None
    return [v] if shard is None else [v, shard]


def vocab_matmuls(matmuls: list, dims: list[int]) -> dict:
    """Every matmul with an operand dimension in `dims` (the vocabulary), as {op, shape (its result),
    operands ("bf16[768,50304]", ...: the program's dtypes), upcast_by_xla, phase, times per step}, and
    whether all take bf16 operands (None when there is none)."""
    found = [mm for mm in matmuls if any(d in dims for _, shape in mm.operands for d in shape)]
    rows = [
        {
            "op": mm.op,
            "shape": list(mm.shape),
            "operands": [f"{d}[{','.join(map(str, s))}]" for d, (_, s) in zip(_dtypes(mm), mm.operands)],
            "upcast_by_xla": mm.upcast_by_xla,
            "phase": mm.phase or "unknown",
            "times": mm.times,
        }
        for mm in found
    ]
    bf16 = all(d == "bf16" for mm in found for d in _dtypes(mm)) if found else None
    return {"vocab_dims": dims, "vocab_matmuls": rows, "vocab_matmuls_bf16": bf16}


def _dtypes(mm) -> tuple[str, ...]:
    return mm.program_dtypes or mm.operand_dtypes


def useful_flops_per_token(cfg: Config, params) -> UsefulFlops:
    import jax

    from trainer.model.model import attention_flops_per_token

    def in_matmul(path) -> bool:
        name = path[-1].key
        # wte is the LM head when tied (a matmul), else only a lookup; wpe is always a lookup.
        return name in ("kernel", "lm_head") or (name == "wte" and cfg.model.tie_embeddings)

    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    matmul_params = sum(int(x.size) for path, x in leaves if in_matmul(path))
    return UsefulFlops(6.0 * matmul_params, float(attention_flops_per_token(cfg.model, causal=True)))


def _ceiling(gpu: str, useful_flops: float, step_flops: float, stats, peak_bytes: int) -> dict:
    peak, capacity, nvlink, network = GPUS[gpu]
    total = stats.total_collective_bytes
    wire = total + stats.collective_bytes["all-reduce"]  # a ring moves an all-reduce's bytes twice
    inter = stats.inter_host_bytes / total if total else 0.0
    t_compute, t_comm = step_flops / peak, wire * ((1 - inter) / nvlink + inter / network)
    return {
        "gpu": gpu,
        "gpu_memory_bytes": capacity,
        "fits": peak_bytes <= MEM_FRACTION * capacity,
        "link_bytes_per_s": {"nvlink": nvlink, "network": network},
        "mfu_ceiling": {
            "compute": useful_flops / step_flops if step_flops else None,
            "serial": (useful_flops / peak) / (t_compute + t_comm) if t_compute + t_comm else None,
        },
    }


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def render(r: dict) -> str:
    b, f = r["bytes_per_device"], r["flops_per_device_per_step"]
    lines = [
        f"{r['config']}: {r['n_params'] / 1e6:.1f}M params on {r['platform']}; attention {r['attention']}",
        f"mesh {' x '.join(f'{k}={v}' for k, v in r['mesh'].items())}; {r['sequences_per_device']} sequences per "
        f"device per step in {r['microbatches']} microbatch(es)",
        "",
        "per device                     bytes",
        *(f"  {k:<28} {_fmt_bytes(v)}" for k, v in b.items()),
        f"  fits {r['gpu']} ({_fmt_bytes(r['gpu_memory_bytes'])} x {MEM_FRACTION}): {'yes' if r['fits'] else 'NO'}",
        "",
        "collectives per step, per device (bytes, ops)",
        *(
            f"  {k:<28} {_fmt_bytes(v)}  x{r['collective_ops_per_step'][k]}"
            for k, v in r["collective_bytes_per_step"].items()
            if r["collective_ops_per_step"][k]
        ),
        f"  {'total':<28} {_fmt_bytes(r['collective_bytes_total'])}"
        f" ({_fmt_bytes(r['collective_bytes_inter_host'])} across hosts of {HOST_GPUS})",
        "",
        f"FLOPs per device per step: model {f['model']:.3g} (the loop's MFU: attention's causal half; "
        f"{f['model_full_attn']:.3g} with the whole L x L, its mfu_full_attn), useful "
        f"{f['useful']:.3g} (matmul params and attention's causal half), compiled matmuls {f['compiled_matmul']:.3g}"
        + (f" + cuDNN attention {f['attention_kernel']:.3g}" if f["attention_kernel"] else "")
        + f", XLA cost analysis {f['xla_cost_analysis']:.3g} (loop bodies once)",
        "compiled matmul FLOPs by operand dtypes: "
        + ", ".join(f"{k} {v / f['compiled_matmul']:.1%}" for k, v in r["matmul_flops_by_operand_dtypes"].items()),
        *(
            [f"cuDNN fused attention calls per step: {', '.join(f'{k} x{v}' for k, v in calls.items())}"]
            if (calls := r["attention_custom_calls"])
            else []
        ),
        f"MFU ceiling on {r['gpu']} (useful FLOPs / the step's at peak; at most 100%): compute "
        f"{_pct(r['mfu_ceiling']['compute'])}, with collectives serial {_pct(r['mfu_ceiling']['serial'])}; "
        f"the loop's MFU reads x{f['model'] / f['useful']:.3f} of this scale (see --help)",
        "",
        f"matmuls with the vocabulary (a dim of {' or '.join(map(str, r['vocab_dims']))}): all bf16 operands: "
        + {True: "yes", False: "NO", None: "none found"}[r["vocab_matmuls_bf16"]],
        *(
            f"  {m['phase']:<9} {' x '.join(m['operands'])} -> {m['shape']}  x{m['times']}  {m['op']}"
            + ("  (compiled with XLA's own upcast)" if m["upcast_by_xla"] else "")
            for m in r["vocab_matmuls"]
        ),
    ]
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        n = device_count(cfg, args.devices)
        devices, platform = _devices(n)
        cfg, note = _stand_in(cfg, devices)
        report = {"config": args.config, "platform": platform, "attention": note, **measure(cfg, devices, args.gpu)}
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0
