"""Run alerts and the dashboard's live extras: step monitors for the gradient-norm trend, throughput drops
and rising ECC counts (which asks the loop to checkpoint now), hardware-health scalars, and restart/runbook
markers. Each alert is an `alert` event plus TensorBoard text saying what it likely means and what the
runbook does about it. No jax here: the supervisor uses ALERTS for its step-overdue alert.
"""

from __future__ import annotations

import collections
import statistics
from pathlib import Path

from trainer.config import Config
from trainer.observe import health
from trainer.observe.events import events_newest_first
from trainer.store import rundir
from trainer.store.event_names import (
    ALERT,
    ALERT_CLEARED,
    CHECKPOINT_NOW,
    HANG_DETECTED,
    HEALTH,
    HEALTH_SOURCE,
    RESTART,
    REWIND,
    RUNBOOK_GAVE_UP,
    SKIP,
    SOFTEN,
    SPIKE_DETECTED,
    STRAGGLER,
    WORKER_READY,
)


class Kind:
    """The alert kinds: an `alert` event's kind, its alerts/<kind> scalar, its ALERTS entry."""

    GRAD_NORM_RISING = "grad_norm_rising"
    THROUGHPUT_DROP = "throughput_drop"
    ECC_RISING = "ecc_rising"
    STRAGGLER = "straggler"  # the supervisor's (trainer.supervise.straggler)
    DISK_FULL = "disk_full"  # the supervisor's (trainer.supervise.storage)
    BUCKET_DOWN = "bucket_down"  # the supervisor's: the durable tier's bucket does not answer
    STEP_OVERDUE = "step_overdue"  # the supervisor's, from the heartbeats


class Do:
    """What a step monitor asks of the loop: its on_step returns None or {"do": one of these, ...}, which
    trainer.train.flags.Flags.act carries out."""

    KEY = "do"
    CHECKPOINT_NOW = "checkpoint_now"  # save at once (and "reason": why)
    HOLD = "hold"  # freeze updates while a spike is probed (trainer.observe.spikes)
    SPIKE = "spike"  # the offending span is known: exit SPIKE for the runbook (trainer.observe.spikes)


# kind -> (what it likely means, what the runbook does about it)
ALERTS = {
    Kind.GRAD_NORM_RISING: (
        "the gradient norm (before clipping) keeps climbing: the leading indicator of instability; a loss "
        "spike or divergence often follows",
        "watch the loss; on a spike the runbook rewinds to the last good checkpoint, skips the offending "
        "batches and, if it recurs, lowers the peak LR / tightens clipping. A steady climb alone: consider "
        "a lower LR or tighter clip at the next restart",
    ),
    Kind.THROUGHPUT_DROP: (
        "tokens/s fell well below its recent median: a straggler device or host, a degraded network link, a "
        "slow input pipeline or thermal/power throttling; money leaks with no crash",
        "compare time/data_wait_s with time/compute_s and the health/* scalars (throttling, one device hotter "
        "or slower); if one node is degraded, drain it: stop at a checkpoint and restart without it (SLURM "
        "exclude / hot spare)",
    ),
    Kind.ECC_RISING: (
        "a device's ECC error count is rising: failing memory, which often precedes an uncorrectable error and a crash",
        "checkpoint now (done automatically), then drain the node: stop at that checkpoint and restart on a "
        "spare, excluding this GPU/host",
    ),
    Kind.STRAGGLER: (
        "one process spends more time on its own work each step than its peers (data, dispatch or other host "
        "work), and in lockstep every process waits for it: the whole group runs at its pace",
        "look at that host (its health line in `status`, its CPU, its input pipeline, a noisy neighbour); with "
        "straggler.action=drain under SLURM with a spare, the supervisor checkpoints and restarts without it",
    ),
    Kind.DISK_FULL: (
        "a checkpoint could not be written for want of space: until there is room, no new checkpoint protects "
        "the run, and a restart would fail again at its next save",
        "free space on the checkpoint filesystem (other jobs' files, old runs, a larger quota) or lower "
        "checkpoint.keep_latest; the supervisor restarts from the newest checkpoint once one more fits, and stops "
        "(exit 81) after supervisor.storage_wait_minutes",
    ),
    Kind.BUCKET_DOWN: (
        "the bucket that holds the durable checkpoints did not answer (after the storage client's own retries): "
        "no new checkpoint protects the run until it does",
        "check the endpoint, the network and the credentials; the supervisor restarts from the newest checkpoint "
        "in the bucket once it answers, and stops (exit 81) after supervisor.storage_wait_minutes",
    ),
    Kind.STEP_OVERDUE: (
        "no heartbeat progress for a long time: a hang (a collective waiting on a dead or stuck rank), a very "
        "slow checkpoint or a stuck input pipeline",
        "the supervisor dumps the Python stacks, kills and restarts the worker from the last checkpoint when "
        "the phase timeout passes; the same step failing again and again stops the run as a crash loop",
    ),
}

# events.jsonl entries drawn as markers on the dashboard (restart from the supervisor, the rest from the
# spike runbook), keyed to their marker name.
MARKERS = {
    RESTART: "restart",
    HANG_DETECTED: "hang",
    SPIKE_DETECTED: "spike",
    REWIND: "rewind",
    SKIP: "skip",
    SOFTEN: "soften",
    RUNBOOK_GAVE_UP: "runbook_gave_up",
    STRAGGLER: "straggler",
}


class Alerter:
    """Writes alerts as events, TensorBoard text and 0/1 scalars; remembers which are open."""

    def __init__(self, events, scalars):
        self.events, self.scalars = events, scalars
        self.open: dict[str, int] = {}

    def fire(self, step: int, kind: str, detail: str, **fields) -> None:
        meaning, runbook = ALERTS[kind]
        self.open[kind] = step
        self.events.write(ALERT, step=step, kind=kind, detail=detail, meaning=meaning, runbook=runbook, **fields)
        self.scalars.add(step, {f"alerts/{kind}": 1.0, "alerts/open": len(self.open)})
        self.scalars.text(
            "alerts", f"**{kind}** at step {step}: {detail}\n\n*Likely:* {meaning}.\n\n*Runbook:* {runbook}.", step
        )

    def clear(self, step: int, kind: str, detail: str) -> None:
        if self.open.pop(kind, None) is None:
            return
        self.events.write(ALERT_CLEARED, step=step, kind=kind, detail=detail)
        self.scalars.add(step, {f"alerts/{kind}": 0.0, "alerts/open": len(self.open)})
        self.scalars.text("alerts", f"cleared **{kind}** at step {step}: {detail}", step)


class GradNormTrend:
    """Median grad norm of the last `window` steps against the `window` before (after warmup)."""

    def __init__(self, alerter: Alerter, *, window: int, rise: float, start_step: int):
        self.alerter, self.window, self.rise, self.start_step = alerter, window, rise, start_step
        self._hist: collections.deque[float] = collections.deque(maxlen=2 * window)

    def on_step(self, step: int, rec: dict) -> None:
        g = rec["grad_norm"]
        if step <= self.start_step or g != g or g == float("inf"):  # NaN/Inf belong to the spike runbook
            return
        self._hist.append(g)
        if len(self._hist) < 2 * self.window:
            return
        h = list(self._hist)
        before, recent = statistics.median(h[: self.window]), statistics.median(h[self.window :])
        ratio = recent / max(before, 1e-12)
        if ratio > self.rise and Kind.GRAD_NORM_RISING not in self.alerter.open:
            self.alerter.fire(
                step,
                Kind.GRAD_NORM_RISING,
                f"median grad norm {before:.3g} -> {recent:.3g} (x{ratio:.2f}) over the last {2 * self.window} steps",
                ratio=ratio,
            )
        elif ratio < (1 + self.rise) / 2:  # hysteresis: no flapping around the threshold
            self.alerter.clear(step, Kind.GRAD_NORM_RISING, f"grad norm trend back to x{ratio:.2f}")


class ThroughputDrop:
    """Recent tokens/s against the median of the last healthy steps; the baseline is frozen while the
    alert is open, so a lasting slowdown stays visible. Steps that saved, and the few after them (the
    async write shares the host), are not judged: a checkpoint is not a straggler."""

    SKIP_FIRST = 2  # the first steps of an attempt include warm-up: not a baseline

    def __init__(self, alerter: Alerter, *, window: int, drop: float, sustain: int):
        self.alerter, self.drop, self.sustain = alerter, drop, sustain
        self._base: collections.deque[float] = collections.deque(maxlen=window)
        self._recent: collections.deque[float] = collections.deque(maxlen=sustain)
        self._seen, self._quiet = 0, 0

    def on_step(self, step: int, rec: dict) -> None:
        self._seen += 1
        if rec["ckpt_block_s"] > 0:
            self._quiet = self.sustain
            return
        if self._quiet or self._seen <= self.SKIP_FIRST:
            self._quiet = max(self._quiet - 1, 0)
            return
        rate = rec["tokens_per_s"]
        self._recent.append(rate)
        is_open = Kind.THROUGHPUT_DROP in self.alerter.open
        if len(self._base) >= max(self._base.maxlen // 2, self.sustain) and len(self._recent) == self.sustain:
            base, now = statistics.median(self._base), statistics.median(self._recent)
            if not is_open and now < self.drop * base:
                self.alerter.fire(
                    step,
                    Kind.THROUGHPUT_DROP,
                    f"median tokens/s of the last {self.sustain} steps "
                    f"{now:,.0f} = {now / base:.0%} of the recent median {base:,.0f}",
                    tokens_per_s=now,
                    baseline=base,
                )
                is_open = True
            elif is_open and now >= (1 + self.drop) / 2 * base:
                self.alerter.clear(step, Kind.THROUGHPUT_DROP, f"tokens/s back to {now / base:.0%} of baseline")
                is_open = False
        if not is_open:
            self._base.append(rate)


class HealthMonitor:
    """Reads the collector's latest snapshot (never waits): health/* scalars and a `health` event every
    log interval; a rising ECC count fires an alert and asks the loop for a checkpoint now."""

    def __init__(self, alerter: Alerter, collector: health.HealthCollector, *, every_steps: int, ecc_rise: int):
        self.alerter, self.collector = alerter, collector
        self.every_steps, self.ecc_rise = every_steps, ecc_rise
        self._seen: dict | None = None
        self._written: dict | None = None
        self._ecc: dict[str, float] | None = None

    def on_step(self, step: int, rec: dict) -> dict | None:
        self.collector.step = step
        snap = self.collector.latest()
        if snap is None:
            return None
        if step % self.every_steps == 0 and snap is not self._written:  # each sample once: 8 GPUs x 10 readings
            self._written = snap
            self.alerter.scalars.add(
                step, {f"health/{dev}/{k}": v for dev, r in snap["devices"].items() for k, v in r.items()}
            )
            self.alerter.events.write(
                HEALTH, step=step, devices=snap["devices"], errors=snap["errors"], sampled_at=snap["time"]
            )
        if snap is self._seen:
            return None
        self._seen = snap
        return self._check_ecc(step, snap)

    def _check_ecc(self, step: int, snap: dict) -> dict | None:
        per_dev = {dev: health.ecc_total({"devices": {dev: r}}) for dev, r in snap["devices"].items()}
        prev, self._ecc = self._ecc, per_dev
        if prev is None:
            return None
        rising = {d: n - prev.get(d, n) for d, n in per_dev.items() if n - prev.get(d, n) >= self.ecc_rise}
        if not rising or Kind.ECC_RISING in self.alerter.open:
            return None
        detail = ", ".join(f"{d} +{n:.0f} (total {per_dev[d]:.0f})" for d, n in rising.items())
        self.alerter.fire(
            step, Kind.ECC_RISING, f"ECC errors rising: {detail}", devices=sorted(rising), action=Do.CHECKPOINT_NOW
        )
        self.alerter.events.write(CHECKPOINT_NOW, step=step, reason=Kind.ECC_RISING, detail=detail)
        self.alerter.scalars.add(step, {"markers/checkpoint_now": 1.0})
        return {Do.KEY: Do.CHECKPOINT_NOW, "reason": Kind.ECC_RISING}


def write_markers(run_dir: Path, scalars) -> None:
    """Restart and runbook markers for what happened since the previous worker got going: each becomes a
    markers/<name> scalar at its step and a line of TensorBoard text."""
    # Read backwards to the previous worker_ready: this runs on every restart, and a weeks-long run's
    # history must not be parsed on the recovery path.
    since = []
    for e in events_newest_first(Path(run_dir) / rundir.EVENTS):
        if e["event"] == WORKER_READY:
            break
        since.append(e)
    for e in reversed(since):
        name = MARKERS.get(e["event"])
        if name and e.get("step") is not None:
            scalars.add(e["step"], {f"markers/{name}": 1.0})
            extra = {k: v for k, v in e.items() if k not in ("event", "time", "step", "by")}
            scalars.text("markers", f"**{name}** at step {e['step']}: {extra}", e["step"])


def build(cfg: Config, *, run_dir: Path, events, host_events, scalars, faults, primary: bool) -> list:
    """The dashboard's monitors for one worker, its health collector started (log.health=false: none). Every
    process watches its own host's health (`host_events`: its events tagged with its process and node, so an
    alert names the host); process 0 also the run's metrics (grad norm, throughput), the same on every process."""
    write_markers(run_dir, scalars)
    if not cfg.log.health:
        return []
    sources, why = health.open_sources()
    host_events.write(
        HEALTH_SOURCE,
        sources=[s.name for s in sources],
        every_s=cfg.log.health_every_s,
        **({"note": why} if why else {}),
    )
    collector = health.HealthCollector(
        every_s=cfg.log.health_every_s, sources=sources, injected_ecc=faults.ecc_errors
    ).start()
    ac = cfg.alerts
    hardware = HealthMonitor(
        Alerter(host_events, scalars), collector, every_steps=cfg.log.every_steps, ecc_rise=ac.ecc_rise
    )
    if not primary:
        return [hardware]
    alerter = Alerter(events, scalars)
    return [
        GradNormTrend(alerter, window=ac.grad_window, rise=ac.grad_rise, start_step=cfg.optim.warmup_steps),
        ThroughputDrop(alerter, window=ac.throughput_window, drop=ac.throughput_drop, sustain=ac.throughput_steps),
        hardware,
    ]
