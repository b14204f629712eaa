"""Renders results.json as the markdown table in benchmarks/results/results.md: one row per ratio with
its target and the limit it is compared with, the GPU rows ("not measured" until run on a GPU), the
supporting numbers, and the machine, versions and command that produced them.
"""

from __future__ import annotations

GPU_ROWS = (  # (label, path into the gpu result, target); MFU counts attention's causal half (gpu_check.py)
    ("MFU, 124M on one H200", ("gpt2-124m", "mfu"), ">= 0.40"),
    ("MFU, ~1B on one H200", ("gpt-1b", "mfu"), ">= 0.50"),
    ("MFU, ~1B Llama (GQA, cuDNN) on one H200", ("llama-1b", "mfu"), ">= 0.50"),
    ("attention that ran, ~1B", ("gpt-1b", "attention"), "-"),
    ("tokens/s, ~1B Llama on one H200", ("llama-1b", "tokens_per_s"), "-"),
    ("step time, ~1B (s)", ("gpt-1b", "step_s"), "-"),
    ("step time, 124M (s)", ("gpt2-124m", "step_s"), "-"),
    ("ckpt blocking / copy limit, ~1B", ("gpt-1b", "blocking_vs_copy_limit"), "<= 1.5"),
    ("ckpt blocking / copy limit, 124M", ("gpt2-124m", "blocking_vs_copy_limit"), "<= 1.5"),
    ("restart with warm compile cache (s)", ("bitwise_resume", "restart_warm_cache_s", "total"), "-"),
    ("bitwise resume (deterministic ops)", ("bitwise_resume", "bitwise_equal"), "equal"),
    ("step time, deterministic ops / default, 124M", ("deterministic_ops_step_time_ratio",), "-"),
    ("inspect: peak bytes per GPU, ~1B (GiB)", ("inspect_1b", "bytes_per_device", "peak_gib"), "-"),
    ("tokens/s FSDP / data parallel, 124M, all GPUs", ("fsdp_vs_data", "fsdp_over_data"), "-"),
    ("step time, latency-hiding scheduler / off, 124M", ("ab_latency_hiding_124m", "step_time_vs_main"), "-"),
    ("step time, unrolled / scanned layers, 124M", ("ab_unrolled_124m", "step_time_vs_main"), "-"),
    ("step time, fallback remat / none, ~1B", ("ab_fallback_remat_1b", "step_time_vs_main"), "-"),
    ("~1B fits at jax's default memory fraction (0.75)", ("ab_default_mem_fraction_1b", "ran"), "-"),
)


def _fmt(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


def _median_cpu_s(saves) -> float | None:
    """Median CPU-seconds of a list of timed saves."""
    if not saves:
        return None
    xs = sorted(x["cpu_s"] for x in saves)
    return xs[len(xs) // 2]


def _met(bench: dict, key: str) -> str:
    met = bench.get("met")
    if isinstance(met, dict):
        met = met.get(key)
    return "—" if met is None else ("met" if met else "**not met**")


def _dig(tree, path: tuple):
    for p in path:
        if not isinstance(tree, dict) or p not in tree:
            return None
        tree = tree[p]
    return tree


def _support(d: dict) -> list[str]:
    """The numbers behind each ratio, one line per benchmark."""
    f, lines = _fmt, []
    if so := d.get("step_overhead"):
        med = so.get("step_s_median") or {}
        lines.append(
            f"- step overhead: trainer {f(so.get('trainer_tokens_per_s'))} tok/s vs bare "
            f"{f(so.get('bare_tokens_per_s'))} tok/s, sliced against each other; per pair "
            f"{', '.join(f(r) for r in so.get('pair_ratios') or [])}; median step {f(med.get('full'))} s vs "
            f"{f(med.get('bare'))} s (ratio {f(so.get('median_step_ratio'))}); CPU-seconds per step ratio "
            f"{f(so.get('cpu_time_ratio'))}; the window's save cost its step "
            f"{', '.join(f(x) for x in so.get('save_step_excess_s') or [])} s over the median"
        )
    if cc := d.get("checkpoint_cost"):
        raw = cc.get("uncompressed_diagnostic", {})
        lines.append(
            f"- checkpoint: {f(cc.get('n_params'))} params, {f((cc.get('state_bytes') or 0) / 1e9)} GB "
            f"state; async blocking {f(cc.get('async_blocking_s'))} s vs sync {f(cc.get('sync_blocking_s'))}"
            f" s (host memcpy limit {f(cc.get('copy_limit_s'))} s); tok/s {f(cc.get('ckpt_tokens_per_s'))}"
            f" with vs {f(cc.get('plain_tokens_per_s'))} without, CPU-time ratio "
            f"{f(cc.get('cpu_time_ratio'))}; a save's write costs {f(cc.get('write_cpu_s'))} CPU-s, so "
            f"{f(cc.get('cpu_bound_throughput_ratio'))} is the most this many cores allow; zstd off "
            f"(diagnostic): throughput ratio {f(raw.get('ckpt_throughput_ratio'))}, write "
            f"{f(_median_cpu_s(raw.get('sync_saves')))} CPU-s"
        )
    if rc := d.get("recovery"):
        cold = rc.get("cold_start_s", {})
        first = (rc.get("recoveries_s") or [{}])[0]
        parts = ", ".join(f"{k} {f(v)}" for k, v in first.items() if k != "first_step_number")
        lines.append(
            f"- recovery (s): {parts}; cold start {f(cold.get('total'))} (compile {f(cold.get('compile'))});"
            f" ratio without the restart delay {f(rc.get('recovery_vs_cold_without_backoff'))}"
        )
    if dh := d.get("data_headroom"):
        g = dh.get("gpu_124m_shape", {})
        lines.append(
            f"- data: pipeline {f(dh.get('pipeline_tokens_per_s'))} tok/s vs trainer "
            f"{f(dh.get('trainer_tokens_per_s'))}; at the 124M GPU shape {f(g.get('tokens_per_s'))} "
            f"tok/s = {f(g.get('headroom_vs_modelled'))}x what 124M eats at 45% MFU on an H200 (modelled)"
        )
        if b := dh.get("gpu_124m_shape_bpe"):
            prep = b["prepared"]
            lines.append(
                f"- data on prepared BPE shards ({prep['tokenizer']}, {prep['dtype']}) at the 124M GPU shape:"
                f" {f(b.get('tokens_per_s'))} tok/s = {f(b.get('headroom_vs_modelled'))}x"
            )
    if gc := d.get("goodput_chaos"):
        lines.append(
            f"- goodput: measured {f(gc.get('measured_goodput'))} vs predicted "
            f"{f(gc.get('predicted_goodput'))} ({f(gc.get('failures'))} crashes, stall "
            f"{f(gc.get('stall_s'))} s, restart {f(gc.get('restart_s'))} s, step {f(gc.get('step_s'))} s)"
        )
    if ct := d.get("checkpoint_tiers"):
        t = ct.get("tiers", {})
        parts = [
            f"{name}: tok/s ratio {f(x.get('ckpt_throughput_ratio'))} (CPU-time {f(x.get('cpu_time_ratio'))}), "
            f"blocking {f(x.get('blocking_s'))} s, seal {f(x.get('seal', {}).get('cpu_s'))} CPU-s, restore "
            f"{f(x.get('restore', {}).get('total_s'))} s (verify {f(x.get('restore', {}).get('verify_s'))})"
            for name, x in t.items()
        ]
        lines.append(f"- tiers, same state and windows: {'; '.join(parts)}")
    if rp := d.get("replica_check"):
        parts = [
            f"{name} ({f(m.get('n_params'))} params): check {f(m.get('check_s'))} s vs step {f(m.get('step_s'))} s"
            for name, m in rp.get("models", {}).items()
        ]
        lines.append(f"- replica check: {'; '.join(parts)}")
    for name, b in d.items():
        if "error" in b:
            lines.append(f"- {name}: FAILED: {b['error'].strip().splitlines()[0] if b['error'].strip() else ''}")
    return lines


def render(res: dict, headlines: dict) -> str:
    d = res.get("details", {})
    out = [
        "# Benchmark results",
        "",
        f"`{res.get('command')}` — {res.get('started_utc')}, {_fmt(res.get('duration_s'))} s"
        + (" (**--quick: smoke settings, numbers mean little**)" if res.get("quick") else ""),
        "",
        "| benchmark | measured | target | | compared with | load avg (before, after) |",
        "|---|---|---|---|---|---|",
    ]
    for key, (bench, target, limit) in headlines.items():
        b = d.get(bench, {})
        measured = "error" if "error" in b else _fmt(res.get(key))
        out.append(f"| `{key}` | {measured} | {target} | {_met(b, key)} | {limit} | {_fmt(b.get('load_avg_1m'))} |")
    gpu = res.get("gpu")
    for label, path, target in GPU_ROWS:
        v = _dig(gpu, path) if isinstance(gpu, dict) else None
        shown, why = (_fmt(v), "") if isinstance(gpu, dict) else ("not measured", "no GPU in this run")
        out.append(f"| gpu: {label} | {shown} | {target} | | {why} | |")
    out += ["", *_support(d)]
    smoke = res.get("gpu_cpu_smoke")
    if smoke:
        out.append(
            f"- GPU script CPU smoke (`python benchmarks/gpu_check.py --cpu-smoke`): "
            f"{'passed' if smoke.get('passed') else 'FAILED'} in {_fmt(smoke.get('wall_s'))} s, bitwise resume "
            f"{_fmt(smoke.get('bitwise_equal'))}"
        )
    m, v, g = res.get("machine", {}), res.get("versions", {}), res.get("git", {})
    out += [
        "",
        "## Machine and versions",
        "",
        f"- {m.get('cpu')} x {m.get('cpu_count')} cores, {m.get('memory_gb')} GB, {m.get('platform')}, "
        f"Python {m.get('python')}; GPUs: {', '.join(m.get('gpu') or []) or 'none'}",
        "- " + ", ".join(f"{k} {val}" for k, val in v.items()),
        f"- git {str(g.get('commit'))[:12]} ({g.get('uncommitted_files')} uncommitted files)",
        "",
        "Method and how to read each ratio: [benchmarks/README.md](../README.md).",
        "",
    ]
    return "\n".join(out)
