"""The run dir's one JSON writer (trainer.store.rundir): strict JSON (a NaN or infinite float is written as
null, which jq, browsers, Go and Rust read; Python's own NaN token they reject), replaced in one rename (no
temporary file left), read back as None when missing or torn; and summary.json's one writer on top of it
(trainer.store.summary)."""

from __future__ import annotations

import json
import math

import pytest

from trainer.store import rundir, summary


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


def test_summary_json_merges_in_place_starts_afresh_or_keeps_named_keys_and_refuses_unknown_ones(tmp_path):
    worker = dict(final_step=10, final_loss=2.5, params_sha256="ab", n_params=7, data_fingerprint="fp", wall_s=3.0)
    summary.update(tmp_path, keep=(), **worker)  # the worker's final figures
    summary.update(tmp_path, goodput={"seconds": {}}, wall_s=9.0, restarts=1)  # a session's ledger over them
    text = (tmp_path / rundir.SUMMARY).read_text()
    assert list(summary.read(tmp_path)) == [*worker, "goodput", "restarts"] and summary.read(tmp_path)["wall_s"] == 9.0
    assert text.startswith('{\n "final_step": 10,\n'), text  # indent 1, as every JSON file we write
    summary.update(tmp_path, keep=("data_fingerprint",), final_step=12, restarts=2)  # a rebuild
    assert summary.read(tmp_path) == {"data_fingerprint": "fp", "final_step": 12, "restarts": 2}
    summary.update(tmp_path, keep=(), final_step=10)  # afresh: nothing of the old file stays
    assert summary.read(tmp_path) == {"final_step": 10}
    with pytest.raises(TypeError, match="has no key"):
        summary.update(tmp_path, final_stpe=11)
    assert summary.read(tmp_path) == {"final_step": 10}
    (tmp_path / rundir.SUMMARY).write_text('{"final_step": 1')  # torn
    assert summary.read(tmp_path) is None
