"""The one TensorBoard writer: scalars grouped by prefix (loss/, optim/, throughput/, time/, health/,
alerts/, goodput/, markers/, runbook/), text, and the resolved config in the HParams tab.

The worker keeps one open for the whole attempt; the supervisor opens one briefly for the goodput ledger
and the runbook's markers, each with its own file-name suffix (two writers opened in the same second
would otherwise share, and truncate, one file).
"""

from __future__ import annotations

import json
from pathlib import Path


class Writer:
    def __init__(self, logdir: Path, *, enabled: bool = True, suffix: str = ""):
        self._w = None
        if enabled:
            from tensorboardX import SummaryWriter  # loaded only by writers that write

            self._w = SummaryWriter(str(logdir), flush_secs=10, filename_suffix=suffix)

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
