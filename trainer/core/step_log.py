"""Each step's metrics, read one step late: the `step` event, TensorBoard scalars, the progress line, and
the monitors (alerts, the spike detector), whose actions go to the loop's flags."""

from __future__ import annotations

import time

import jax

from trainer.core import mesh as mesh_lib
from trainer.core.flags import Flags
from trainer.core.model import flops_per_token
from trainer.core.worker import Worker
from trainer.observe.event_names import STEP
from trainer.observe.progress import Progress


class StepLog:
    """Each step's metrics, read one step late (by then the device has them): the `step` event, TensorBoard
    scalars every log interval, the progress line, and the monitors, whose actions go to the flags."""

    def __init__(self, w: Worker, flags: Flags):
        cfg = w.cfg
        self.w, self.flags = w, flags
        self.tokens_per_step = cfg.data.batch_size * cfg.model.seq_len
        self.flops_per_token = flops_per_token(cfg.model, w.n_params)
        self.peak = mesh_lib.peak_flops(cfg.log.peak_flops) * jax.device_count()
        self.progress = Progress(cfg.train.steps, cfg.log.progress and w.primary)
        self.pending = None  # (step, metrics on device, data wait s)
        self.ckpt_s = 0.0  # blocking seconds of a save right after the pending step
        self.eval_s = 0.0  # seconds of an eval right after the pending step (left out of its tokens/s)
        self.t_prev = time.perf_counter()
        self.loss: float | None = None  # None: no step ran in this attempt

    def dispatched(self, step: int, m, data_wait: float) -> None:
        if self.pending:
            self._emit(*self.pending)
        self.pending, self.ckpt_s, self.eval_s = (step, m, data_wait), 0.0, 0.0

    def flush(self) -> float:
        if self.pending:
            self._emit(*self.pending)
            self.pending = None
        self.progress.done()
        return self.loss

    def _emit(self, step: int, m, data_wait: float) -> None:
        w, ckpt_s = self.w, self.ckpt_s
        m = {k: float(v) for k, v in jax.device_get(m).items()}
        now = time.perf_counter()
        dt, self.t_prev = now - self.t_prev, now
        tps = self.tokens_per_step / max(dt - self.eval_s, 1e-9)
        rec = dict(m, tokens_per_s=tps, step_s=dt, data_wait_s=data_wait, ckpt_block_s=ckpt_s)
        if self.eval_s:
            rec["eval_s"] = self.eval_s
        if self.peak:
            rec["mfu"] = tps * self.flops_per_token / self.peak
        w.events.write(STEP, step=step, **rec)
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
