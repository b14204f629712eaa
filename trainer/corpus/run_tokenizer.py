"""The tokenizer a run trained with, found from its checkpoint's metadata: through data.path or the run's
`data_ready` events to the prepared DIR whose fingerprint the checkpoint records (`export` ships its file,
`sample` encodes and decodes with it).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from trainer.config import ConfigError
from trainer.corpus import shards, tokenizer
from trainer.observe.events import iter_events
from trainer.store import rundir
from trainer.store.event_names import DATA_READY


@dataclasses.dataclass(frozen=True)
class RunTokenizer:
    name: str  # as meta.json names it: bytes | bpe:N | tokenizer.json sha256:... | tiktoken:NAME | imported tokens
    eos_id: int
    dir: Path | None  # the prepared DIR it was read from; None: the bytes tokenizer (no file to find)

    @property
    def file(self) -> Path | None:
        """The Hugging Face tokenizer.json (bpe:N and tokenizer.json specs), exported with the model."""
        f = self.dir / tokenizer.HF_FILE if self.dir else None
        return f if f and f.is_file() else None

    def load(self) -> tokenizer.Tok:
        """The tokenizer itself (to encode and decode); ConfigError when the run has none."""
        if self.name == tokenizer.IMPORTED:
            raise ConfigError(
                f"the run trained on imported token ids ({self.dir}): there is no tokenizer to "
                f"encode or decode text with"
            )
        return tokenizer.of_prepared(self.name, self.file)


def tokenizer_of(run_dir: Path | None, meta: dict) -> RunTokenizer:
    """The tokenizer of the data the checkpoint was trained on: found through data.path or the run's
    `data_ready` events, and checked against the checkpoint's data fingerprint."""
    data = meta["config"]["data"]
    ready = None
    if run_dir is not None:  # every start logs one; the data cannot change on resume, so the first one suffices
        ready = next((e for e in iter_events(Path(run_dir) / rundir.EVENTS) if e["event"] == DATA_READY), None)
    places = [Path(p).expanduser() for p in (data["path"], (ready or {}).get("dir")) if p]
    for d in places:
        if shards.is_prepared(d):
            prepared = json.loads((d / shards.META).read_text())
            if prepared["fingerprint"] == meta["data_fingerprint"]:
                return RunTokenizer(prepared["tokenizer"], prepared["eos_id"], d)
    # The bytes tokenizer needs no file: enough to know that the run used it.
    path = Path(data["path"]).expanduser()
    raw = not data["path"] or (path.exists() and not shards.is_prepared(path))  # data.tokenizer applied to it
    name = ready["tokenizer"] if ready else data["tokenizer"] if raw else None
    if name == tokenizer.BYTES.name:
        return RunTokenizer(name, tokenizer.BYTES.eos_id, None)
    raise ConfigError(
        f"the data this checkpoint was trained on (tokenizer {name or data['tokenizer']!r}, fingerprint "
        f"{meta['data_fingerprint'][:12]}) is not where the run found it "
        f"({', '.join(map(str, places)) or 'no data_ready event'}); prepare it again there"
    )
