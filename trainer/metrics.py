"""Run outputs: events.jsonl, TensorBoard scalars, the console progress line, MFU and params hash."""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

# Dense bf16 peak FLOP/s per device, by substring of jax's device_kind.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "V100": 125e12}


def peak_flops(configured: float) -> float:
    if configured:
        return configured
    kind = jax.devices()[0].device_kind
    return next((v for k, v in PEAK_FLOPS.items() if k in kind), 0.0)


class EventLog:
    """One JSON object per line; only the primary process writes."""

    def __init__(self, path: Path, enabled: bool = True):
        self._fh = open(path, "a", buffering=1) if enabled else None

    def write(self, event: str, step: int | None = None, **fields) -> None:
        if self._fh is None:
            return
        rec = {"event": event, "time": time.time()}
        if step is not None:
            rec["step"] = step
        rec.update(fields)
        self._fh.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        if self._fh:
            self._fh.close()


class Scalars:
    """TensorBoard scalars grouped by prefix (loss/, optim/, throughput/, time/, checkpoint/...)."""

    def __init__(self, logdir: Path, enabled: bool = True):
        self._w = None
        if enabled:
            from tensorboardX import SummaryWriter

            self._w = SummaryWriter(str(logdir), flush_secs=10)

    def add(self, step: int, values: dict[str, float]) -> None:
        if self._w:
            for k, v in values.items():
                self._w.add_scalar(k, float(v), step)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        if self._w:
            self._w.add_text(tag, text, step)

    def hparams(self, config: dict, metric_tags: tuple[str, ...]) -> None:
        """The resolved config in TensorBoard's HParams tab, in this run's own log dir (tensorboardX's
        add_hparams would open a sibling dir) so the listed metrics are this run's scalars."""
        if not self._w:
            return
        from tensorboardX.summary import hparams

        flat = {}
        stack = [("", config)]
        while stack:
            prefix, node = stack.pop()
            for k, v in node.items():
                if isinstance(v, dict):
                    stack.append((f"{prefix}{k}.", v))
                else:
                    flat[prefix + k] = v if isinstance(v, (bool, int, float, str)) else json.dumps(v)
        for summary in hparams(flat, dict.fromkeys(metric_tags, 0.0)):
            self._w.file_writer.add_summary(summary)

    def close(self) -> None:
        if self._w:
            self._w.close()


class Progress:
    """A single console line: step, loss, tokens/s and ETA."""

    def __init__(self, total: int, enabled: bool):
        self._total, self._enabled = total, enabled
        self._tty = sys.stderr.isatty()

    def update(self, step: int, loss: float, tokens_per_s: float, sec_per_step: float) -> None:
        if not self._enabled:
            return
        eta = max(self._total - step, 0) * sec_per_step
        bar_n = int(20 * step / self._total)
        line = (f"[{'#' * bar_n}{'.' * (20 - bar_n)}] step {step}/{self._total}  loss {loss:.4f}  "
                f"{tokens_per_s:,.0f} tok/s  ETA {_fmt_s(eta)}")
        print(("\r" + line) if self._tty else line, end="" if self._tty else "\n", file=sys.stderr, flush=True)

    def done(self) -> None:
        if self._enabled and self._tty:
            print(file=sys.stderr)


def _fmt_s(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def params_sha256(params) -> str:
    """sha256 over the bytes of every parameter, gathered to host, in sorted key-path order."""
    from jax.experimental import multihost_utils

    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    h = hashlib.sha256()
    for _path, leaf in sorted(leaves, key=lambda kv: jax.tree_util.keystr(kv[0])):
        if jax.process_count() > 1:
            arr = multihost_utils.process_allgather(leaf, tiled=True)
        else:
            arr = jax.device_get(leaf)
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()
