"""The run dir's one JSON writer (trainer.store.rundir): strict JSON (a NaN or infinite float is written as
null, which jq, browsers, Go and Rust read; Python's own NaN token they reject), replaced in one rename (no
temporary file left), read back as None when missing or torn."""

from __future__ import annotations

import json
import math

from trainer.store import rundir


def test_json_is_strict_nonfinite_floats_are_null_and_a_torn_file_reads_as_none(tmp_path):
    path = tmp_path / "summary.json"
    rundir.write_json(path, {"loss": math.nan, "v": [1.5, math.inf, -math.inf], "n": {"x": math.nan, "k": 3}})
    rundir.write_json(path, {"loss": math.nan, "v": (1.5, math.inf, -math.inf), "n": {"x": math.nan, "k": 3}})
    text = path.read_text()
    strict = json.loads(text, parse_constant=lambda token: f"non-standard {token}")
    assert strict == {"loss": None, "v": [1.5, None, None], "n": {"x": None, "k": 3}}, text
    assert rundir.read_json(path) == strict
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]  # replaced by a rename: no temporary
    path.write_text(text[: len(text) // 2])  # torn by a kill
    assert rundir.read_json(path) is None and rundir.read_json(tmp_path / "missing.json") is None
