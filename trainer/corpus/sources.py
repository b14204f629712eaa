"""Input corpora as a stream of documents, in a fixed order: a text file (one document), a directory
(its .txt/.md/.py files one document each, its .jsonl/.parquet files one per record, in sorted path
order), a .jsonl file (one document per line: its text field) or a .parquet file (its text column).
The embedded default corpus is the Python standard library's own sources.

Which documents are held out for validation is a fixed rule on the document index (`is_val`), so
the training data never depends on whether eval is on.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from trainer.config import ConfigError

TEXT_SUFFIXES = (".txt", ".md", ".py")
RECORD_SUFFIXES = (".jsonl", ".parquet")
VAL_RULE = "document i (0-based, input order) is held out when floor((i+1)*F) > floor(i*F), F = val_fraction"


@dataclass(frozen=True)
class Source:
    name: str  # recorded in meta.json: the input path, or python-stdlib:<dir>
    files: tuple[Path, ...]
    text_field: str

    @property
    def n_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def max_tokens(self) -> int | None:
        """An upper bound on the tokens of any tokenizer (at most one per byte, plus the end-of-text ids),
        exact for bytes on text files; None when unknown (parquet is compressed)."""
        if any(f.suffix == ".parquet" for f in self.files):
            return None
        return sum(f.stat().st_size + (f.suffix != ".jsonl") for f in self.files)

    def stat_key(self) -> str:
        """Names, sizes and mtimes: enough to tell an unchanged corpus without reading it."""
        return "".join(f"{f}:{(st := f.stat()).st_size}:{st.st_mtime_ns}\n" for f in self.files)

    def documents(self) -> Iterator[str | bytes]:
        """Every document in order: bytes for plain text files (the byte tokenizer sees them exactly),
        str for records of .jsonl/.parquet files."""
        for f in self.files:
            if f.suffix == ".jsonl":
                yield from _jsonl(f, self.text_field)
            elif f.suffix == ".parquet":
                yield from _parquet(f, self.text_field)
            else:
                yield f.read_bytes()

    def check(self) -> None:
        """Fail early, before any work, on a record file without the text field (first record only)."""
        for f in self.files:
            if f.suffix in RECORD_SUFFIXES:
                next(iter(_jsonl(f, self.text_field) if f.suffix == ".jsonl" else _parquet(f, self.text_field)), None)


def is_val(i: int, fraction: Fraction) -> bool:
    return (i + 1) * fraction // 1 > i * fraction // 1


def val_fraction(value: float, key: str) -> Fraction:
    if not 0.0 <= value < 1.0:
        raise ConfigError(f"{key} must be in [0, 1), got {value}")
    return Fraction(repr(value))  # exact: the rule must not depend on float rounding


def open_source(path: str, *, text_field: str, default_corpus_mb: float, key: str = "data.path") -> Source:
    """The documents at `path` ("" = the embedded default corpus); `key` names the setting in errors."""
    if not path:
        return default_corpus(default_corpus_mb, text_field)
    src = Path(path).expanduser()
    if not src.exists():
        raise ConfigError(f"{key} not found: {path} (point it at a text, .jsonl or .parquet file, or a directory)")
    if src.is_file():
        return Source(str(src.resolve()), (src.resolve(),), text_field)
    suffixes = TEXT_SUFFIXES + RECORD_SUFFIXES
    files = tuple(sorted(p.resolve() for p in src.rglob("*") if p.is_file() and p.suffix in suffixes))
    if not files:
        raise ConfigError(f"{key} {path}: no {'/'.join(suffixes)} files inside")
    return Source(str(src.resolve()), files, text_field)


def default_corpus(cap_mb: float, text_field: str = "text") -> Source:
    """The standard library's own .py sources: present wherever Python is, never downloaded."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests"}
    found = []
    for root, dirs, names in os.walk(stdlib):  # every worker start lists it: never walk what is skipped
        dirs[:] = [d for d in dirs if d not in skip]
        found += [Path(root, n) for n in names if n.endswith(".py")]
    files = sorted(p for p in found if not skip & set(p.parts))
    chosen, total = [], 0
    for p in files:
        size = p.stat().st_size
        if total + size > cap_mb * 1e6:
            break
        chosen.append(p)
        total += size
    return Source(f"python-stdlib:{stdlib}", tuple(chosen), text_field)


def _jsonl(path: Path, field: str) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                raise ConfigError(f"{path} line {n}: not valid JSON (one JSON object per line)") from None
            if not isinstance(rec, dict) or not isinstance(rec.get(field), str):
                have = ", ".join(sorted(rec)[:8]) if isinstance(rec, dict) else type(rec).__name__
                raise ConfigError(
                    f"{path} line {n}: no text field {field!r} (it has: {have}); "
                    f"pass --text-field NAME (data.text_field)"
                )
            yield rec[field]


def _parquet(path: Path, field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's ArrowInvalid and friends: say which file
        raise ConfigError(f"{path}: not a readable parquet file ({str(e)[:120]})") from None
    names = pf.schema_arrow.names
    if field not in names:
        raise ConfigError(
            f"{path}: no column {field!r} (columns: {', '.join(names[:12])}); pass --text-field NAME (data.text_field)"
        )
    for batch in pf.iter_batches(columns=[field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield text
