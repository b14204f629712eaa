"""Presentation for `python -m trainer survival`: the text table, the PNG U-curve and the interactive HTML page.

The page's JavaScript re-implements trainer.survival.model.expectation; tests/test_survival_page.py keeps them equal.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from trainer.survival.model import (
    NEVER_FINISHES_RATIO,
    Inputs,
    expectation,
    recommend_interval_min,
)


def _n(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:,.{digits}f}"


def _interval_text(inputs: dict[str, Any]) -> str:
    iv = inputs["interval_min"]
    return "never checkpointing" if iv == "never" else f"checkpoint every {iv:.4g} min"


def table(r: dict[str, Any]) -> str:
    i, ex = r["inputs"], r["exact"]
    lines = [
        (
            f"run survival: {i['gpus']:,} GPUs x {i['days']:g} days = {_n(r['run_gpu_hours'], 0)} GPU-hours of work,"
            f" MTBF {i['mtbf_hours']:,.0f} h per GPU"
        ),
        (
            f"{_interval_text(i)}, stall {i['stall_s']:g} s per save, restart {i['restart_min']:g} min,"
            f" healthy MFU {i['mfu']:.3f}"
        ),
        "",
        f"  expected failures        {r['expected_failures']:>14.2f}",
        f"  lost per crash           {_n(r['lost_per_crash_gpu_hours']):>14} GPU-h",
        f"  recompute                {_n(r['recompute_gpu_hours']):>14} GPU-h",
        (
            f"  checkpoint overhead      {_n(r['checkpoint_overhead_gpu_hours']):>14} GPU-h"
            f"  ({r['checkpoints']:,.0f} saves)"
        ),
        f"  restart downtime         {_n(r['restart_gpu_hours']):>14} GPU-h",
        f"  wasted                   {_n(r['wasted_gpu_hours']):>14} GPU-h  ({r['wasted_fraction']:.2%} of all spent)",
        f"  effective MFU            {r['effective_mfu']:>14.4f}",
        (f"  exact Poisson model      {_days(ex)} expected to finish, effective MFU {ex['effective_mfu']:.4f}"),
        f"  verdict                  {r['verdict']}: {r['verdict_detail']}",
    ]
    for key, render in (("since_checkpoint", _since), ("sweep", _sweep), ("monte_carlo", _mc), ("from_run", _run)):
        if key in r:
            lines += ["", *render(r[key], r)]
    lines += [f"wrote {path}" for path in r.get("written", [])]
    return "\n".join(lines)


def _days(ex: dict[str, Any]) -> str:
    if ex["expected_completion_days"] is None or ex["expected_completion_days"] > 1e6:
        return f"10^{ex['expected_completion_log10_days']:.1f} days"
    return f"{ex['expected_completion_days']:,.2f} days"


def _since(s: dict[str, Any], r: dict[str, Any]) -> list[str]:
    return [
        (
            f"a crash {s['hours']:g} h after the last checkpoint loses {s['hours']:g} h x {r['inputs']['gpus']:,} GPUs"
            f" = {_n(s['lost_gpu_hours'], 0)} GPU-hours"
        )
    ]


def _sweep(s: dict[str, Any], r: dict[str, Any]) -> list[str]:
    lo, hi = s["search_min"]
    return [
        (
            f"sweep over {lo:g}..{hi:g} min: optimum {s['optimum_interval_min']:.1f} min"
            f" ({_n(s['wasted_at_optimum_gpu_hours'])} GPU-h wasted"
            f"; {_n(s['wasted_at_search_edges_gpu_hours'][0], 0)} and {_n(s['wasted_at_search_edges_gpu_hours'][1], 0)}"
            " at the edges)"
        ),
        f"  Young sqrt(2 x stall x MTBF_system)   {s['young_interval_min']:8.1f} min",
        f"  Daly higher-order                     {s['daly_interval_min']:8.1f} min",
        f"  exact-model optimum                   {s['exact_optimum_interval_min']:8.1f} min",
    ]


def _mc(m: dict[str, Any], r: dict[str, Any]) -> list[str]:
    if m.get("skipped"):
        return [f"monte carlo skipped: {m['skipped']}"]

    def ms(s: dict[str, float], digits: int) -> str:
        return f"{s['mean']:,.{digits}f} +- {s['se']:,.{digits}f}"

    return [
        f"monte carlo ({m['runs']:,} runs, seed {m['seed']}), mean +- standard error:",
        f"  failures      {ms(m['failures'], 2)}   (expectation model {r['expected_failures']:.2f})",
        (
            f"  wasted GPU-h  {ms(m['wasted_gpu_hours'], 1)}   (expectation model {_n(r['wasted_gpu_hours'])},"
            f" z = {m['z_vs_expectation_wasted']:.2f}: {'agrees' if m['agrees_with_expectation'] else 'DISAGREES'})"
        ),
        (
            f"  days          {ms(m['completion_days'], 3)}   (exact model {_days(r['exact'])},"
            f" z = {m['z_vs_exact_completion']:.2f}: {'agrees' if m['agrees_with_exact'] else 'DISAGREES'})"
        ),
    ]


def _run(info: dict[str, Any], r: dict[str, Any]) -> list[str]:
    return [
        f"from run {info['run_dir']}: measured {json.dumps(info['measured'])}",
        *(f"  - {note}" for note in info["notes"]),
        f"recommended interval for {r['inputs']['gpus']:,} GPUs: {info['recommended_interval_min']:.1f} min",
    ]


def curve(inp: Inputs, lo: float = 1.0, hi: float = 720.0, points: int = 200) -> list[dict[str, float]]:
    xs = [lo * (hi / lo) ** (k / (points - 1)) for k in range(points)]
    return [{"interval_min": x, **expectation(replace(inp, interval_min=x))} for x in xs]


def write_plot(inp: Inputs, path: Path) -> None:
    """Stacked U-curve of wasted GPU-hours against the checkpoint interval, optimum marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    opt = recommend_interval_min(
        stall_s=inp.stall_s, restart_s=inp.restart_min * 60, gpus=inp.gpus, mtbf_hours=inp.mtbf_hours
    )
    pts = curve(inp, min(1.0, opt / 4), max(720.0, opt * 4))
    xs = [p["interval_min"] for p in pts]
    parts = [[p[k] for p in pts] for k in ("restart_gpu_hours", "checkpoint_overhead_gpu_hours", "recompute_gpu_hours")]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    ax.stackplot(xs, *parts, labels=["restart downtime", "checkpoint overhead", "recompute"], alpha=0.8)
    best = expectation(replace(inp, interval_min=opt))["wasted_gpu_hours"]
    ax.axvline(opt, color="k", ls="--", lw=1)
    ax.plot([opt], [best], "ko", label=f"optimum {opt:.1f} min ({best:,.0f} GPU-h)")
    if inp.interval_min is not None and xs[0] <= inp.interval_min <= xs[-1]:
        now = expectation(inp)["wasted_gpu_hours"]
        ax.plot([inp.interval_min], [now], "o", mfc="none", mec="red", mew=2, label=f"chosen {inp.interval_min:g} min")
    ax.set(
        xscale="log",
        xlabel="checkpoint interval (min)",
        ylabel="expected wasted GPU-hours",
        ylim=(0, 4 * best),
        title=f"{inp.gpus:,} GPUs, MTBF {inp.mtbf_hours:,.0f} h, {inp.days:g} days",
    )
    ax.legend(loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render_page(inp: Inputs) -> str:
    initial = asdict(inp) | {"never": inp.interval_min is None, "interval_min": inp.interval_min or 60.0}
    initial["never_finishes_ratio"] = NEVER_FINISHES_RATIO
    return PAGE_TEMPLATE.replace("__INITIAL__", json.dumps(initial))


def write_page(inp: Inputs, path: Path) -> None:
    path.write_text(render_page(inp))


# The JS below mirrors trainer.survival (expectation, exact, verdict, _search_range, _minimise) line for line.
PAGE_TEMPLATE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Run survival</title>
<style>
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222;max-width:1100px}
.wrap{display:flex;gap:2em;flex-wrap:wrap} .ctl label{display:block;margin:.5em 0 0}
.ctl input[type=range]{width:260px} table{border-collapse:collapse} td{padding:2px 10px}
td.v{text-align:right;font-variant-numeric:tabular-nums;font-weight:600} #verdict{font-weight:700}
svg text{font-size:11px;fill:#444}
</style></head><body>
<h2>Run survival: what failures cost a long run</h2>
<div class="wrap"><div class="ctl">
<label>GPUs <span id="gpus_value"></span><br><input type="range" id="gpus" min="1" max="16384" step="1"></label>
<label>MTBF per GPU (h) <span id="mtbf_hours_value"></span><br>
<input type="range" id="mtbf_hours" min="1000" max="200000" step="1000"></label>
<label>checkpoint interval (min) <span id="interval_min_value"></span><br>
<input type="range" id="interval_min" min="1" max="720" step="1"></label>
<label><input type="checkbox" id="never"> never checkpoint</label>
<label>run length (days) <span id="days_value"></span><br>
<input type="range" id="days" min="1" max="90" step="1"></label>
<label>stall per save (s) <span id="stall_s_value"></span><br>
<input type="range" id="stall_s" min="0" max="120" step="0.5"></label>
<label>restart downtime (min) <span id="restart_min_value"></span><br>
<input type="range" id="restart_min" min="0" max="120" step="1"></label>
<label>healthy MFU <span id="mfu_value"></span><br>
<input type="range" id="mfu" min="0.05" max="0.8" step="0.01"></label>
</div><div>
<table>
<tr><td>expected failures</td><td class="v" id="expected_failures"></td><td></td></tr>
<tr><td>lost per crash</td><td class="v" id="lost_per_crash_gpu_hours"></td><td>GPU-h</td></tr>
<tr><td>recompute</td><td class="v" id="recompute_gpu_hours"></td><td>GPU-h</td></tr>
<tr><td>checkpoint overhead</td><td class="v" id="checkpoint_overhead_gpu_hours"></td><td>GPU-h</td></tr>
<tr><td>restart downtime</td><td class="v" id="restart_gpu_hours"></td><td>GPU-h</td></tr>
<tr><td>wasted</td><td class="v" id="wasted_gpu_hours"></td><td>GPU-h</td></tr>
<tr><td>wasted fraction</td><td class="v" id="wasted_fraction"></td><td>of all GPU-h spent</td></tr>
<tr><td>effective MFU</td><td class="v" id="effective_mfu"></td><td></td></tr>
<tr><td>optimum interval</td><td class="v" id="optimum_interval"></td><td>min</td></tr>
<tr><td>Young's interval</td><td class="v" id="young_interval"></td><td>min</td></tr>
<tr><td>exact model: completion</td><td class="v" id="expected_completion_days"></td><td>days</td></tr>
<tr><td>verdict</td><td colspan="2" id="verdict"></td></tr>
</table>
<svg id="chart" width="640" height="320" viewBox="0 0 640 320"></svg>
<div class="legend"><span style="color:#55a868">&#9632;</span> recompute
<span style="color:#dd8452">&#9632;</span> checkpoint overhead <span style="color:#4c72b0">&#9632;</span> restart
downtime &nbsp; <b>- - &#9679;</b> optimum &nbsp; <span style="color:#c00">&#9675;</span> chosen interval</div>
</div></div>
<script>
"use strict";
const INITIAL = __INITIAL__;
const FIELDS = ["gpus", "mtbf_hours", "interval_min", "days", "stall_s", "restart_min", "mfu"];
const VERDICTS = [[0.02, "healthy"], [0.10, "acceptable"], [0.30, "wasteful"], [Infinity, "ruinous"]];
const $ = (id) => document.getElementById(id);

function expectation(p) {
  const runH = p.days * 24.0, runGpuH = p.gpus * runH, failures = runGpuH / p.mtbf_hours;
  let lostH, checkpoints;
  if (p.interval_min === null) { lostH = runH / 2.0; checkpoints = 0.0; }
  else { const tauH = p.interval_min / 60.0; lostH = Math.min(tauH, runH) / 2.0; checkpoints = runH / tauH; }
  const lost = lostH * p.gpus, recompute = failures * lost;
  const overhead = checkpoints * p.stall_s / 3600.0 * p.gpus;
  const restart = failures * p.restart_min / 60.0 * p.gpus;
  const wasted = recompute + overhead + restart;
  return {run_gpu_hours: runGpuH, expected_failures: failures, checkpoints: checkpoints,
    lost_per_crash_gpu_hours: lost, recompute_gpu_hours: recompute, checkpoint_overhead_gpu_hours: overhead,
    restart_gpu_hours: restart, wasted_gpu_hours: wasted, wasted_fraction: wasted / (runGpuH + wasted),
    effective_mfu: p.mfu * runGpuH / (runGpuH + wasted)};
}
function segments(p) {
  const runH = p.days * 24.0;
  if (p.interval_min === null) return [[1, runH, 0.0]];
  const tau = Math.min(p.interval_min / 60.0, runH), save = p.stall_s / 3600.0;
  const full = Math.floor(runH / tau + 1e-9), segs = [[full, tau, save]], rest = runH - full * tau;
  if (rest > 1e-9 * runH) segs.push([1, rest, save]);
  return segs;
}
function logExpm1(x) { return x > 50 ? x + Math.log1p(-Math.exp(-x)) : Math.log(Math.expm1(x)); }
function logSumExp(v) {
  const top = Math.max(...v);
  return top + Math.log(v.reduce((a, x) => a + Math.exp(x - top), 0));
}
function exactLog10Days(p) {
  const lam = p.gpus / p.mtbf_hours, restartH = p.restart_min / 60.0;
  const logF = logSumExp(segments(p).map(([n, w, s]) => Math.log(n) + logExpm1(lam * (w + s))));
  const logT = logF + Math.log(1 / lam + restartH);
  return {days: (logT - Math.log(24.0)) / Math.LN10, ratio: (logT - Math.log(p.days * 24.0)) / Math.LN10};
}
function verdict(m, ex) {
  if (ex.ratio > Math.log10(INITIAL.never_finishes_ratio)) return "practically never finishes";
  return VERDICTS.find(([limit]) => m.wasted_fraction < limit)[1];
}
function youngMin(p) { return Math.sqrt(2 * p.stall_s * p.mtbf_hours * 3600 / p.gpus) / 60; }
function searchRange(p) {
  const y = youngMin(p);
  return [Math.max(Math.min(1.0, y / 4), 1 / 60), Math.max(720.0, y * 4)];
}
function minimise(f, lo, hi, points = 240) {
  const xs = []; for (let i = 0; i < points; i++) xs.push(lo * (hi / lo) ** (i / (points - 1)));
  let best = 0; for (let i = 1; i < points; i++) if (f(xs[i]) < f(xs[best])) best = i;
  let a = xs[Math.max(best - 1, 0)], b = xs[Math.min(best + 1, points - 1)];
  const g = (Math.sqrt(5) - 1) / 2; let c = b - g * (b - a), d = a + g * (b - a);
  for (let k = 0; k < 80; k++) {
    if (f(c) < f(d)) { b = d; d = c; c = b - g * (b - a); } else { a = c; c = d; d = a + g * (b - a); }
  }
  return (a + b) / 2;
}
function wastedAt(p, t) { return expectation({...p, interval_min: t}).wasted_gpu_hours; }
function fmt(x, digits) {
  if (!isFinite(x)) return "n/a";
  const [i, f] = Math.abs(x).toFixed(digits).split(".");
  return (x < 0 ? "-" : "") + i.replace(/\B(?=(\d{3})+(?!\d))/g, ",") + (f ? "." + f : "");
}
function params() {
  const p = {}; for (const k of FIELDS) p[k] = parseFloat($(k).value);
  if ($("never").checked) p.interval_min = null;
  return p;
}
function render() {
  const p = params(), m = expectation(p), ex = exactLog10Days(p);
  const opt = minimise((t) => wastedAt(p, t), ...searchRange(p));
  for (const k of FIELDS) $(k + "_value").textContent = $(k).value;
  if (p.interval_min === null) $("interval_min_value").textContent = "never";
  $("interval_min").disabled = p.interval_min === null;
  $("expected_failures").textContent = fmt(m.expected_failures, 2);
  for (const k of ["lost_per_crash_gpu_hours", "recompute_gpu_hours", "checkpoint_overhead_gpu_hours",
    "restart_gpu_hours", "wasted_gpu_hours"]) $(k).textContent = fmt(m[k], 1);
  $("wasted_fraction").textContent = fmt(100 * m.wasted_fraction, 2) + "%";
  $("effective_mfu").textContent = fmt(m.effective_mfu, 4);
  $("optimum_interval").textContent = fmt(opt, 1);
  $("young_interval").textContent = fmt(youngMin(p), 1);
  $("expected_completion_days").textContent = ex.days < 6 ? fmt(10 ** ex.days, 2) : "10^" + ex.days.toFixed(1);
  $("verdict").textContent = verdict(m, ex);
  drawChart(p, opt);
}
function drawChart(p, opt) {
  const W = 640, H = 320, L = 70, R = 10, T = 10, B = 40, [lo, hi] = searchRange(p);
  const best = wastedAt(p, opt), ymax = 4 * best, pts = [];
  for (let i = 0; i < 120; i++) {
    const t = lo * (hi / lo) ** (i / 119);
    pts.push([t, expectation({...p, interval_min: t})]);
  }
  const X = (t) => L + (W - L - R) * Math.log(t / lo) / Math.log(hi / lo);
  const Y = (v) => T + (H - T - B) * (1 - Math.min(v, ymax) / ymax);
  const layers = [["restart_gpu_hours", "#4c72b0"], ["checkpoint_overhead_gpu_hours", "#dd8452"],
    ["recompute_gpu_hours", "#55a868"]];
  let base = pts.map(() => 0), svg = "";
  for (const [k, color] of layers) {
    const top = pts.map(([, m], i) => base[i] + m[k]);
    const up = pts.map(([t], i) => X(t) + "," + Y(top[i]));
    const down = pts.map(([t], i) => X(t) + "," + Y(base[i])).reverse();
    svg += `<polygon fill="${color}" fill-opacity="0.8" points="${up.concat(down).join(" ")}">`;
    svg += `<title>${k}</title></polygon>`;
    base = top;
  }
  for (const t of [1, 2, 5, 10, 20, 60, 120, 360, 720, 1440, 2880]) if (t >= lo && t <= hi)
    svg += `<line x1="${X(t)}" x2="${X(t)}" y1="${H - B}" y2="${H - B + 4}" stroke="#444"/>`
      + `<text x="${X(t)}" y="${H - B + 16}" text-anchor="middle">${t}</text>`;
  for (let j = 0; j <= 4; j++)
    svg += `<text x="${L - 6}" y="${Y(ymax * j / 4) + 4}" text-anchor="end">${fmt(ymax * j / 4, 0)}</text>`;
  svg += `<line x1="${X(opt)}" x2="${X(opt)}" y1="${T}" y2="${H - B}" stroke="#000" stroke-dasharray="4 3"/>`;
  svg += `<circle id="optimum_marker" cx="${X(opt)}" cy="${Y(best)}" r="4"/>`;
  if (p.interval_min !== null && p.interval_min >= lo && p.interval_min <= hi)
    svg += `<circle cx="${X(p.interval_min)}" cy="${Y(wastedAt(p, p.interval_min))}" r="5" fill="none"`
      + ` stroke="#c00" stroke-width="2"/>`;
  svg += `<text x="${(L + W) / 2}" y="${H - 6}" text-anchor="middle">checkpoint interval (min, log scale)</text>`;
  svg += `<text x="14" y="${H / 2}" transform="rotate(-90 14 ${H / 2})" text-anchor="middle">`
    + "expected wasted GPU-hours</text>";
  svg += `<rect x="${L}" y="${T}" width="${W - L - R}" height="${H - T - B}" fill="none" stroke="#888"/>`;
  $("chart").innerHTML = svg;
}
for (const k of FIELDS) {
  const el = $(k), v = INITIAL[k];
  el.max = Math.max(parseFloat(el.max), v); el.min = Math.min(parseFloat(el.min), v);
  // A measured value (e.g. a 3.27 s stall) must not snap to the slider's step.
  if (Math.abs((v - el.min) / el.step - Math.round((v - el.min) / el.step)) > 1e-9) el.step = "any";
  el.value = v;
  el.addEventListener("input", render);
}
$("never").checked = INITIAL.never;
$("never").addEventListener("input", render); $("never").addEventListener("change", render);
render();
</script></body></html>
"""
