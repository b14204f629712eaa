"""Each step's metrics, read one step late: the `step` event, TensorBoard scalars, the progress line, and
the monitors (alerts, the spike detector), whose actions go to the loop's flags."""

from __future__ import annotations

import time

import jax

from trainer.model.model import flops_per_token
from trainer.observe import downtime
from trainer.observe.progress import Progress
from trainer.parallel import mesh as mesh_lib
from trainer.store.event_names import DOWNTIME, STEP
from trainer.train.flags import Flags
from trainer.train.worker import Worker

MARKS = 4  # window marks in the heartbeat: the supervisor misses none unless it falls 4 windows behind


class StepLog:
    """Each step's metrics, read one step late (by then the device has them): the `step` event, TensorBoard
    scalars every log interval, the progress line, and the monitors, whose actions go to the flags."""

    def __init__(self, w: Worker, flags: Flags, *, start: int):
        cfg = w.cfg
        self.w, self.flags = w, flags
        self.tokens_per_step = cfg.data.batch_size * cfg.model.seq_len
        # MFU counts attention's causal half (llm.c's and MaxText's convention, the anchors we compare with);
        # `mfu_full_attn` beside it is the whole L x L (nanoGPT's and PaLM's), the figure logged before.
        self.flops_per_token = flops_per_token(cfg.model, w.n_params)
        self.flops_per_token_full_attn = flops_per_token(cfg.model, w.n_params, causal=False)
        self.peak = mesh_lib.peak_flops(cfg.log.peak_flops) * jax.device_count()
        self.progress = Progress(cfg.train.steps, cfg.log.progress and w.primary, every=cfg.log.every_steps)
        self.pending = None  # (step, metrics on device, data wait s)
        self.peer_s = 0.0  # seconds waiting on the group since the last emit: a step call that ran the step
        # On GPUs the step call only queues the step: its time is host work (launching kernels), and a process
        # waits on its peers when it reads the results. XLA:CPU runs much of the step inside the call, waiting
        # there for its peers in the collectives: device time. A call that returns with its results ready
        # (`sync` counts those steps) ran all of it: that step's host work can never overlap the device's
        # (docs/multihost.md#stragglers has the measured shares).
        self.runs_in_call = jax.default_backend() == "cpu"
        self.sync = False
        # What the supervisor's straggler watch compares across processes (trainer.supervise.straggler):
        # cumulative seconds over this attempt's clean steps, in every heartbeat. Not counted: the first
        # grace_steps steps, and grace_steps after each save or eval (their own steps are not clean either).
        self.grace = cfg.straggler.grace_steps
        self.quiet_until = start + self.grace
        # The heartbeat carries the counters as they stood at each of the last MARKS multiples of window_steps
        # clean steps: the supervisor compares every process over the same steps, whatever its poll rate.
        self.timing = dict(n=0, step_s=0.0, wait_s=0.0, data_s=0.0, dispatch_s=0.0, sync=0)
        self.window = cfg.straggler.window_steps
        self.marks: list[dict] = []
        self.timed = cfg.straggler.enabled and jax.process_count() > 1  # no one reads it otherwise
        if self.timed:
            w.heartbeat.timing = self.marks
        self.ckpt_s = 0.0  # blocking seconds of a save right after the pending step
        self.eval_s = 0.0  # seconds of an eval right after the pending step (left out of its tokens/s)
        self.t_prev = time.perf_counter()
        self.loss: float | None = None  # None: no step ran in this attempt

    def dispatched(self, step: int, m, data_wait: float, dispatch_s: float) -> None:
        """Step `step` was dispatched (its batch took `data_wait` s, the call `dispatch_s` s): emits the
        previous step, whose interval these two belong to."""
        if self.runs_in_call:
            self.peer_s, dispatch_s = self.peer_s + dispatch_s, 0.0
        self.sync = self.timed and jax.tree.leaves(m)[0].is_ready()
        if self.pending:
            self._emit(*self.pending, now=(data_wait, dispatch_s))
        self.pending, self.ckpt_s, self.eval_s = (step, m, data_wait), 0.0, 0.0

    def flush(self) -> float:
        if self.pending:
            self._emit(*self.pending)
            self.pending = None
        self.progress.done()
        return self.loss

    def _emit(self, step: int, m, data_wait: float, *, now: tuple[float, float] | None = None) -> None:
        w, ckpt_s = self.w, self.ckpt_s
        t0 = time.perf_counter()
        m = {k: float(v) for k, v in jax.device_get(m).items()}
        t1 = time.perf_counter()
        dt, self.t_prev = t1 - self.t_prev, t1
        self._time(step, dt, t1 - t0 + self.peer_s, now)
        self.peer_s = 0.0
        tps = self.tokens_per_step / max(dt - self.eval_s, 1e-9)
        rec = dict(m, tokens_per_s=tps, step_s=dt, data_wait_s=data_wait, ckpt_block_s=ckpt_s)
        if self.eval_s:
            rec["eval_s"] = self.eval_s
        if self.peak:
            rec["mfu"] = tps * self.flops_per_token / self.peak
            rec["mfu_full_attn"] = tps * self.flops_per_token_full_attn / self.peak
        w.events.write(STEP, step=step, **rec)
        if self.loss is None and w.primary and (failure := downtime.handed_over()):  # the attempt's first step
            marks = dict(w.marks, started=downtime.process_start(), stepped=time.time())
            w.events.write(DOWNTIME, step=step, **downtime.event_fields(failure, marks), first_step_s=dt)
        for mon in w.monitors:
            if (action := mon.on_step(step, rec)) is not None:
                self.flags.act(step, action)
        if step % w.cfg.log.every_steps == 0:
            w.scalars.add(
                step,
                {
                    "loss/train": m["loss"],
                    "optim/grad_norm": m["grad_norm"],
                    "optim/update_norm": m["update_norm"],
                    "optim/lr": m["lr"],
                    "throughput/tokens_per_s": tps,
                    "time/step_s": dt,
                    "time/data_wait_s": data_wait,
                    "time/ckpt_block_s": ckpt_s,
                    "time/compute_s": max(dt - data_wait - ckpt_s, 0.0),
                    **({"throughput/mfu": rec["mfu"]} if self.peak else {}),
                },
            )
        self.progress.update(step, m["loss"], tps, dt)
        self.loss = m["loss"]

    def _time(self, step: int, dt: float, wait: float, now: tuple[float, float] | None) -> None:
        """Count this interval (since the previous emit: the next batch, its dispatch, waiting for this
        step's results) in the clean-step timing, unless a save or an eval ran in it or it is in a grace."""
        if self.ckpt_s or self.eval_s:
            self.quiet_until = step + self.grace
        elif self.timed and now is not None and step > self.quiet_until:
            t = self.timing
            t["n"] += 1
            t["step_s"] += dt
            t["wait_s"] += min(wait, dt)
            t["data_s"] += now[0]
            t["dispatch_s"] += now[1]
            t["sync"] += self.sync
            if t["n"] % self.window == 0:
                self.marks.append(dict(t, step=step))
                del self.marks[:-MARKS]
