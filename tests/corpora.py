"""Shared pieces of the data tests (not a test module): small real corpora made from the Python standard
library's sources, and `python -m trainer prepare` as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, child_env

from trainer.corpus import sources


def code_jsonl(path: Path, mb: float, *, field: str = "text") -> Path:
    """One JSON record per stdlib .py file (its text under `field`, plus its path), about `mb` MB."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as fh:
            for f in sources.default_corpus(mb).files:
                fh.write(json.dumps({"path": str(f), field: f.read_text(errors="replace")}) + "\n")
    return path


def prepare_cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer", "prepare", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or child_env(),
    )


def prepared(directory: Path, *args: str) -> Path:
    """`prepare ... --out DIR` once (a fixture's cache); asserts it succeeded."""
    if not (directory / "meta.json").is_file():
        p = prepare_cli(*args, "--out", directory)
        assert p.returncode == 0, p.stderr[-3000:]
    return directory


def meta(directory: Path) -> dict:
    return json.loads((Path(directory) / "meta.json").read_text())


def files_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(directory).iterdir())}
