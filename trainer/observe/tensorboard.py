"""The one TensorBoard writer: scalars grouped by prefix (loss/, optim/, throughput/, time/, health/,
alerts/, goodput/, markers/, runbook/), text, and the resolved config in the HParams tab.

The worker keeps one open for the whole attempt (process 0: the run's; every other process: its host's
health/ and alerts/ in tb/hosts/p<process>-<node>, a run of its own that TensorBoard draws beside the main
one, so a hot or throttled host shows against the others); the supervisor opens one briefly for the goodput ledger
and the runbook's markers, each with its own file-name suffix (two writers opened in the same second
would otherwise share, and truncate, one file).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from trainer.observe.events import NO_SPACE


class Writer:
    def __init__(self, logdir: Path, *, enabled: bool = True, suffix: str = "", only: tuple[str, ...] = ()):
        """`only`: write just the scalars whose tags start with one of these (a host's own health and alerts)."""
        self._w = None
        self.only = only
        if enabled:  # loaded only by writers that write
            self._w = _summary_writer()(str(logdir), flush_secs=10, filename_suffix=suffix)
            _guard_disk_full(self._w, logdir)

    def add(self, step: int, values: dict[str, float]) -> None:
        if self._w:
            for k, v in values.items():
                if not self.only or k.startswith(self.only):
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


def _summary_writer() -> type:
    """tensorboardX's SummaryWriter, imported without torch: where torch is installed (the export check
    needs it) tensorboardX imports it only to accept torch tensors, which we never write, and that import
    costs seconds at every worker start and every supervisor ledger write."""
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # `import torch` raises ImportError: tensorboardX goes on without it
    try:
        from tensorboardX import SummaryWriter
    finally:
        if hide:
            del sys.modules["torch"]
    return SummaryWriter


class _NoSpaceGuard:
    """Stands in for tensorboardX's record writer, which its background thread writes through: a full disk
    drops TensorBoard records (one warning on stderr) instead of killing that thread, after which every
    add_scalar would block forever on the thread's full queue and stall training."""

    def __init__(self, inner, logdir: Path):
        self._inner, self._logdir, self._warned = inner, logdir, False

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except OSError as e:
            if e.errno not in NO_SPACE:
                raise
            if not self._warned:
                print(
                    f"warning: {self._logdir}: no space left on the device; TensorBoard records are dropped "
                    f"until there is (training and checkpoints carry on)",
                    file=sys.stderr,
                    flush=True,
                )
                self._warned = True

    def write_event(self, event):
        return self._call(self._inner.write_event, event)

    def flush(self):
        return self._call(self._inner.flush)

    def close(self):
        return self._call(self._inner.close)


def _guard_disk_full(w, logdir: Path) -> None:
    # tensorboardX offers no hook for write errors: wrap the record writer its thread and close() use. The
    # only private tensorboardX names we touch (SummaryWriter._get_file_writer, EventFileWriter._ev_writer and
    # its _worker._record_writer), here alone; checked against tensorboardX 2.6.5. An upgrade that moves them
    # fails at the first writer's start (AttributeError), never silently.
    events = w._get_file_writer().event_writer
    guard = _NoSpaceGuard(events._ev_writer, logdir)
    events._ev_writer = events._worker._record_writer = guard
