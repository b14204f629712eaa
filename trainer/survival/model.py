"""Run-survival model: what GPU failures, checkpoint stalls and restarts cost a long run.

The expectation model, the exact Poisson model, Monte Carlo and the interval sweep (vs Young and Daly).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

# Beyond this ratio of expected completion time to the run's own length the run "practically never finishes".
NEVER_FINISHES_RATIO = 10.0
# Monte Carlo refuses runs that would need more simulated failures than this per run.
MC_MAX_FAILURES_PER_RUN = 1e6
MC_DRAWS_PER_CHUNK = 4_000_000
VERDICTS = ((0.02, "healthy"), (0.10, "acceptable"), (0.30, "wasteful"), (math.inf, "ruinous"))


@dataclass(frozen=True)
class Inputs:
    gpus: int = 1024
    mtbf_hours: float = 50_000.0  # per GPU
    interval_min: float | None = 60.0  # None means "never checkpoint"
    days: float = 21.0
    stall_s: float = 5.0  # GPU-visible cost of one save
    restart_min: float = 10.0  # downtime per failure
    mfu: float = 0.45  # of a healthy step

    @property
    def run_hours(self) -> float:
        return self.days * 24.0

    @property
    def rate_per_hour(self) -> float:
        """System failure rate: any one of the GPUs failing stops the whole job."""
        return self.gpus / self.mtbf_hours


def expectation(inp: Inputs) -> dict[str, float]:
    """The lesson's first-order model; every cost is in GPU-hours (wall hours x GPUs)."""
    run_h = inp.run_hours
    run_gpu_h = inp.gpus * run_h
    failures = run_gpu_h / inp.mtbf_hours
    if inp.interval_min is None:
        lost_h, checkpoints = run_h / 2.0, 0.0  # every crash rewinds to the start
    else:
        tau_h = inp.interval_min / 60.0
        lost_h, checkpoints = min(tau_h, run_h) / 2.0, run_h / tau_h
    lost = lost_h * inp.gpus
    recompute = failures * lost
    overhead = checkpoints * inp.stall_s / 3600.0 * inp.gpus
    restart = failures * inp.restart_min / 60.0 * inp.gpus
    wasted = recompute + overhead + restart
    return {
        "run_gpu_hours": run_gpu_h,
        "expected_failures": failures,
        "checkpoints": checkpoints,
        "lost_per_crash_gpu_hours": lost,
        "recompute_gpu_hours": recompute,
        "checkpoint_overhead_gpu_hours": overhead,
        "restart_gpu_hours": restart,
        "wasted_gpu_hours": wasted,
        "wasted_fraction": wasted / (run_gpu_h + wasted),
        "effective_mfu": inp.mfu * run_gpu_h / (run_gpu_h + wasted),
    }


def lost_for_crash(hours_since_checkpoint: float, gpus: int) -> float:
    """GPU-hours one crash throws away: everything since the last checkpoint, on every GPU."""
    return hours_since_checkpoint * gpus


def _segments(inp: Inputs) -> list[tuple[int, float, float]]:
    """The run as (count, work hours, save hours) segments; a crash repeats only its own segment."""
    run_h = inp.run_hours
    if inp.interval_min is None:
        return [(1, run_h, 0.0)]
    tau = min(inp.interval_min / 60.0, run_h)
    save = inp.stall_s / 3600.0
    full = int(run_h / tau + 1e-9)
    segs = [(full, tau, save)]
    rest = run_h - full * tau
    if rest > 1e-9 * run_h:
        segs.append((1, rest, save))
    return segs


def _log_expm1(x: float) -> float:
    return x + math.log1p(-math.exp(-x)) if x > 50 else math.log(math.expm1(x))


def _logsumexp(values: list[float]) -> float:
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def exact(inp: Inputs) -> dict[str, Any]:
    """Expected completion under Poisson failures: per segment E = (1/lambda + R)(exp(lambda(tau+stall)) - 1).

    Worked in log space because "never" on a large cluster overflows a double.
    """
    lam, restart_h = inp.rate_per_hour, inp.restart_min / 60.0
    segs = [(math.log(n), _log_expm1(lam * (w + s))) for n, w, s in _segments(inp)]
    log_f = _logsumexp([ln + le for ln, le in segs])  # expected failures: sum of n (e^x - 1)
    log_t = log_f + math.log(1 / lam + restart_h)
    ratio_log10 = (log_t - math.log(inp.run_hours)) / math.log(10)
    t_h = math.exp(log_t) if log_t < 700 else None
    return {
        "expected_completion_days": None if t_h is None else t_h / 24.0,
        "expected_completion_log10_days": (log_t - math.log(24.0)) / math.log(10),
        "expected_failures": math.exp(log_f) if log_f < 700 else None,
        "wasted_gpu_hours": None if t_h is None else (t_h - inp.run_hours) * inp.gpus,
        "effective_mfu": inp.mfu * math.exp(-ratio_log10 * math.log(10)),
        "completion_ratio_log10": ratio_log10,
        "practically_never_finishes": ratio_log10 > math.log10(NEVER_FINISHES_RATIO),
    }


def verdict(model: dict[str, float], ex: dict[str, Any]) -> tuple[str, str]:
    if ex["practically_never_finishes"]:
        days = _pow10(ex["expected_completion_log10_days"])
        return "practically never finishes", f"the exact model expects {days} days"
    frac = model["wasted_fraction"]
    label = next(name for limit, name in VERDICTS if frac < limit)
    return label, f"{frac:.1%} of all GPU-hours spent are wasted"


def _pow10(log10: float) -> str:
    return f"{10**log10:.3g}" if log10 < 15 else f"10^{log10:.1f}"


def _minimise(f: Callable[[float], float], lo: float, hi: float, points: int = 240) -> float:
    """Log-spaced grid search then golden-section refinement between the best point's neighbours."""
    xs = [lo * (hi / lo) ** (i / (points - 1)) for i in range(points)]
    best = min(range(points), key=lambda i: f(xs[i]))
    a, b = xs[max(best - 1, 0)], xs[min(best + 1, points - 1)]
    g = (math.sqrt(5) - 1) / 2
    c, d = b - g * (b - a), a + g * (b - a)
    for _ in range(80):
        if f(c) < f(d):
            b, d = d, c
            c = b - g * (b - a)
        else:
            a, c = c, d
            d = a + g * (b - a)
    return (a + b) / 2


def young_min(stall_s: float, gpus: int, mtbf_hours: float) -> float:
    return math.sqrt(2 * stall_s * mtbf_hours * 3600 / gpus) / 60


def daly_min(stall_s: float, gpus: int, mtbf_hours: float) -> float:
    """Daly (2006) higher-order optimum, compute time between checkpoints."""
    m = mtbf_hours * 3600 / gpus
    if stall_s >= 2 * m:
        return m / 60
    x = stall_s / (2 * m)
    return (math.sqrt(2 * stall_s * m) * (1 + math.sqrt(x) / 3 + x / 9) - stall_s) / 60


def _search_range(stall_s: float, gpus: int, mtbf_hours: float) -> tuple[float, float]:
    # The lesson's 1..720 min, widened when the analytic optimum sits near or beyond an edge.
    young = young_min(stall_s, gpus, mtbf_hours)
    return max(min(1.0, young / 4), 1 / 60), max(720.0, young * 4)


def recommend_interval_min(*, stall_s: float, restart_s: float, gpus: int, mtbf_hours: float) -> float:
    """Checkpoint interval (minutes) minimising expected wasted GPU-hours; restart_s sets the level, not the optimum."""
    base = Inputs(gpus=gpus, mtbf_hours=mtbf_hours, stall_s=stall_s, restart_min=restart_s / 60)
    lo, hi = _search_range(stall_s, gpus, mtbf_hours)
    return _minimise(lambda t: expectation(replace(base, interval_min=t))["wasted_gpu_hours"], lo, hi)


def sweep(inp: Inputs) -> dict[str, Any]:
    lo, hi = _search_range(inp.stall_s, inp.gpus, inp.mtbf_hours)
    opt = recommend_interval_min(
        stall_s=inp.stall_s, restart_s=inp.restart_min * 60, gpus=inp.gpus, mtbf_hours=inp.mtbf_hours
    )

    lam, save = inp.rate_per_hour, inp.stall_s / 3600.0

    def exact_rate(t: float) -> float:
        # Expected wall time per unit of work, (e^(lambda(tau+stall)) - 1) / tau up to a constant; taken
        # continuous in tau because the run's last, shorter segment only adds a sawtooth around the optimum.
        return math.expm1(min(lam * (t / 60.0 + save), 700.0)) / t

    def wasted(t: float) -> float:
        return expectation(replace(inp, interval_min=t))["wasted_gpu_hours"]

    return {
        "optimum_interval_min": opt,
        "young_interval_min": young_min(inp.stall_s, inp.gpus, inp.mtbf_hours),
        "daly_interval_min": daly_min(inp.stall_s, inp.gpus, inp.mtbf_hours),
        "exact_optimum_interval_min": _minimise(exact_rate, lo, hi),
        "search_min": [lo, hi],
        "wasted_at_optimum_gpu_hours": wasted(opt),
        "wasted_at_search_edges_gpu_hours": [wasted(lo), wasted(hi)],
        "interior": lo * 1.01 < opt < hi / 1.01,
    }


def _mc_sums(rng: Any, runs: int, count: int, work: float, save: float, lam: float) -> tuple[Any, Any]:
    """Failures and lost hours per run for `count` identical segments (failures per segment are geometric)."""
    import numpy as np

    span = work + save
    failures = rng.negative_binomial(count, math.exp(-lam * span), size=runs)
    lost = np.zeros(runs)
    # Lost time of a failed attempt: exponential truncated to the attempt, drawn in bounded chunks.
    start, cum = 0, np.cumsum(failures)
    while start < runs:
        base = cum[start - 1] if start else 0
        stop = max(int(np.searchsorted(cum, base + MC_DRAWS_PER_CHUNK, side="right")), start + 1)
        ks = failures[start:stop]
        u = rng.random(int(ks.sum()))
        x = -np.log1p(-u * -math.expm1(-lam * span)) / lam
        lost[start:stop] = np.bincount(np.repeat(np.arange(stop - start), ks), weights=x, minlength=stop - start)
        start = stop
    return failures, lost


def monte_carlo(inp: Inputs, runs: int, seed: int) -> dict[str, Any]:
    """Simulate failures as a Poisson process; compare mean +- standard error with both models."""
    import numpy as np

    ex, model = exact(inp), expectation(inp)
    if ex["expected_failures"] is None or ex["expected_failures"] > MC_MAX_FAILURES_PER_RUN:
        return {"skipped": "the exact model expects too many failures per run to simulate", "runs": 0}
    rng, lam = np.random.default_rng(seed), inp.rate_per_hour
    failures, lost, saves = np.zeros(runs), np.zeros(runs), 0.0
    for count, work, save in _segments(inp):
        k, x = _mc_sums(rng, runs, count, work, save, lam)
        failures, lost, saves = failures + k, lost + x, saves + count * save
    restart_h = failures * inp.restart_min / 60.0
    wasted = (lost + saves + restart_h) * inp.gpus
    days = (inp.run_hours + wasted / inp.gpus) / 24.0

    def stat(a: Any) -> dict[str, float]:
        return {"mean": float(a.mean()), "se": float(a.std(ddof=1) / math.sqrt(runs)) if runs > 1 else math.nan}

    out: dict[str, Any] = {"runs": runs, "seed": seed, "failures": stat(failures), "wasted_gpu_hours": stat(wasted)}
    out["completion_days"] = stat(days)
    out["recompute_gpu_hours"] = stat(lost * inp.gpus)
    out["z_vs_expectation_wasted"] = _z(out["wasted_gpu_hours"], model["wasted_gpu_hours"])
    out["z_vs_expectation_failures"] = _z(out["failures"], model["expected_failures"])
    out["z_vs_exact_completion"] = _z(out["completion_days"], ex["expected_completion_days"])
    out["agrees_with_expectation"] = abs(out["z_vs_expectation_wasted"]) <= 3
    out["agrees_with_exact"] = abs(out["z_vs_exact_completion"]) <= 3
    return out


def _z(s: dict[str, float], target: float) -> float:
    return (s["mean"] - target) / s["se"] if s["se"] > 0 else (0.0 if s["mean"] == target else math.inf)
