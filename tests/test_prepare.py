"""`python -m trainer prepare`: tokenizers (bytes, bpe:N, tokenizer.json, tiktoken only when cached), input
formats (.jsonl, .parquet, text directories), whole documents held out, output independent of --workers,
pre-tokenized imports, and bad input as one line with exit 2 and nothing written. No jax involved."""

from __future__ import annotations

import json
import os
from fractions import Fraction

import numpy as np
import pytest
from conftest import child_env
from corpora import code_jsonl, files_bytes, meta, prepare_cli, prepared

from trainer.config import ConfigError, DataConfig
from trainer.corpus import cache, shards, sources


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    return code_jsonl(tmp_path_factory.mktemp("jsonl") / "code.jsonl", 1.6)  # > 2 x 2 workers' chunks in flight


@pytest.fixture(scope="module")
def bpe(tmp_path_factory, jsonl):
    return prepared(
        tmp_path_factory.mktemp("bpe") / "out",
        "--input",
        jsonl,
        "--tokenizer",
        "bpe:512",
        "--val-fraction",
        "0.1",
        "--shard-tokens",
        "40000",
    )


def _tokens(directory, split: str) -> np.ndarray:
    m = meta(directory)
    parts = [np.fromfile(directory / s["file"], dtype=m["dtype"]) for s in m["shards"] if s["split"] == split]
    return np.concatenate(parts) if parts else np.zeros(0, m["dtype"])


def test_bpe_meta_shards_and_whole_documents_held_out(bpe, jsonl):
    m = meta(bpe)
    assert (m["tokenizer"], m["vocab_size"], m["eos_id"], m["dtype"]) == ("bpe:512", 512, 0, "uint16")
    assert m["n_tokens"] == _tokens(bpe, "train").size and m["n_val_tokens"] == _tokens(bpe, "val").size
    assert sum(s["split"] == "train" for s in m["shards"]) > 1  # cut every 40,000 tokens
    assert m["fingerprint"] == shards.fingerprint(m["dtype"], m["shards"]) and 2.0 < m["bytes_per_token"] < 5
    # The split holds exactly the documents the fixed rule names, each whole and ended by eos.
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(bpe / "tokenizer.json"))
    docs = [json.loads(line)["text"] for line in jsonl.read_text().splitlines()]
    held = docs[9::10]  # F = 1/10: documents 9, 19, 29, ...
    assert [i for i in range(len(docs)) if sources.is_val(i, Fraction(1, 10))] == list(range(9, len(docs), 10))
    val = _tokens(bpe, "val")
    ends = np.flatnonzero(val == m["eos_id"])
    assert len(ends) == len(held) == round(len(docs) * 0.1) and ends[-1] == val.size - 1
    starts = np.concatenate([[0], ends[:-1] + 1])
    assert [tok.decode(val[s:e].tolist()) for s, e in zip(starts, ends)] == held
    assert np.sum(_tokens(bpe, "train") == m["eos_id"]) == len(docs) - len(held)


def test_output_does_not_depend_on_the_worker_count(tmp_path, jsonl, bpe):
    two = prepared(
        tmp_path / "two",
        "--input",
        jsonl,
        "--tokenizer",
        "bpe:512",
        "--val-fraction",
        "0.1",
        "--shard-tokens",
        "40000",
        "--workers",
        "2",
    )
    assert files_bytes(two) == files_bytes(bpe)


def test_a_tokenizer_json_path_reproduces_the_bpe_tokens(tmp_path, jsonl, bpe):
    again = prepared(
        tmp_path / "again",
        "--input",
        jsonl,
        "--tokenizer",
        bpe / "tokenizer.json",
        "--val-fraction",
        "0.1",
        "--shard-tokens",
        "40000",
    )
    assert meta(again)["tokenizer"].startswith("tokenizer.json sha256:") and meta(again)["vocab_size"] == 512
    assert meta(again)["fingerprint"] == meta(bpe)["fingerprint"]


def test_parquet_directory_and_jsonl_give_the_same_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = ["first document", "second, ünïcode", "third"]
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"body": docs, "id": [1, 2, 3]}), tmp_path / "docs.parquet")
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    for i, d in enumerate(docs):
        (tmp_path / "in" / f"{i}.txt").write_text(d)
    outs = [
        prepared(tmp_path / f"out{k}", "--input", tmp_path / name, "--text-field", "body", "--val-fraction", "0")
        for k, name in enumerate(("docs.parquet", "docs.jsonl", "in"))
    ]
    want = np.concatenate([np.append(np.frombuffer(d.encode(), np.uint8), 256) for d in docs])
    for out in outs:
        assert (_tokens(out, "train") == want).all() and meta(out)["tokenizer"] == "bytes"


def test_from_tokens_imports_nanogpt_train_and_val_bins(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "nano").mkdir()
    train, val = rng.integers(0, 50257, 100_000, dtype=np.uint16), rng.integers(0, 50257, 5_000, dtype=np.uint16)
    train.tofile(tmp_path / "nano" / "train.bin")
    val.tofile(tmp_path / "nano" / "val.bin")
    out = prepared(
        tmp_path / "out",
        "--from-tokens",
        tmp_path / "nano",
        "--dtype",
        "uint16",
        "--vocab-size",
        "50257",
        "--eos-id",
        "50256",
        "--shard-tokens",
        "30000",
    )
    m = meta(out)
    assert (m["n_tokens"], m["n_val_tokens"], m["eos_id"], m["dtype"]) == (100_000, 5_000, 50256, "uint16")
    assert (_tokens(out, "train") == train).all() and (_tokens(out, "val") == val).all()
    assert [s["n_tokens"] for s in m["shards"]] == [30000, 30000, 30000, 10000, 5000]
    bad = prepare_cli(
        "--from-tokens", tmp_path / "nano", "--dtype", "uint16", "--vocab-size", "1000", "--out", tmp_path / "bad"
    )
    assert bad.returncode == 2 and "--vocab-size 1000" in bad.stderr and not (tmp_path / "bad").exists()


def _fails(tmp_path, *args, env=None) -> str:
    p = prepare_cli(*args, "--out", tmp_path / "never", env=env)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    assert not (tmp_path / "never").exists()
    return lines[0]


def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, jsonl):
    import pyarrow as pa
    import pyarrow.parquet as pq

    assert "bpe:N needs a whole N" in _fails(tmp_path, "--input", jsonl, "--tokenizer", "bpe:lots")
    assert "is not one of bytes, bpe:N" in _fails(tmp_path, "--input", jsonl, "--tokenizer", "wordpiece")
    assert "no text field 'content'" in _fails(tmp_path, "--input", jsonl, "--text-field", "content")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "t.parquet")
    assert "no column 'text' (columns: body)" in _fails(tmp_path, "--input", tmp_path / "t.parquet")
    assert "--input not found" in _fails(tmp_path, "--input", tmp_path / "missing.txt")
    (tmp_path / "odd.bin").write_bytes(b"abc")
    assert "not a whole number of uint16" in _fails(
        tmp_path, "--from-tokens", tmp_path / "odd.bin", "--dtype", "uint16", "--vocab-size", "300"
    )
    # tiktoken: nothing is downloaded; an encoding whose file is not cached locally is refused.
    env = dict(child_env(), TIKTOKEN_CACHE_DIR=str(tmp_path / "empty-cache"))
    assert "tiktoken" in _fails(tmp_path, "--input", jsonl, "--tokenizer", "tiktoken:gpt2", env=env)
    existing = tmp_path / "exists"
    existing.mkdir()
    p = prepare_cli("--input", jsonl, "--out", existing)
    assert p.returncode == 2 and "already exists" in p.stderr and list(existing.iterdir()) == []


def _start_error(cfg, process: int = 0) -> str | None:
    """What a training start says about its data (cache.ensure: the data step of every worker start), or None."""
    try:
        cache.ensure(cfg, process=process)
    except ConfigError as e:
        return str(e)
    return None


def test_a_text_file_is_one_document_and_a_directory_reads_records_one_each(tmp_path):
    """README's --input forms: a text file is one document (its blank lines and newlines stay inside it, so it
    has no validation split), and a directory's .jsonl/.parquet files give one document per record, its text
    files one each, in sorted path order, other files ignored."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = "first paragraph\n\nsecond paragraph\nits second line\n"
    (tmp_path / "in" / "a").mkdir(parents=True)
    (tmp_path / "in" / "c.txt").write_text(text)
    (tmp_path / "in" / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in ("r1", "r2")))
    pq.write_table(pa.table({"text": ["p1", "p2"]}), tmp_path / "in" / "a" / "z.parquet")
    (tmp_path / "in" / "notes.csv").write_text("not,text\n")
    eos = lambda d: np.append(np.frombuffer(d.encode(), np.uint8), 256)  # noqa: E731
    one = prepared(tmp_path / "one", "--input", tmp_path / "in" / "c.txt", "--val-fraction", "0.5")
    assert meta(one)["n_val_tokens"] == 0 and _tokens(one, "train").tolist() == eos(text).tolist()
    mixed = prepared(tmp_path / "mixed", "--input", tmp_path / "in", "--val-fraction", "0")
    want = np.concatenate([eos(d) for d in ("p1", "p2", "r1", "r2", text)])  # a/z.parquet < b.jsonl < c.txt
    assert _tokens(mixed, "train").tolist() == want.tolist()


def test_a_vocabulary_past_65536_gets_uint32_shards_checked_at_start(tmp_path):
    """uint16 while the vocabulary fits, else uint32 (ids past 65535 intact); a training start checks every
    shard's size against meta.json and refuses one that is not its length in tokens (a byte too many, or
    a token too few: a torn copy), in one line naming the fix."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 70_000)}, "<|endoftext|>": 70_000}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    docs = ["w69999 w65536 w7", "w65535 w1"]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = prepared(
        tmp_path / "out",
        "--input",
        tmp_path / "docs.jsonl",
        "--tokenizer",
        tmp_path / "tokenizer.json",
        "--val-fraction",
        "0",
    )
    m = meta(out)
    assert (m["vocab_size"], m["eos_id"]) == (70_001, 70_000)
    assert m["dtype"] == "uint32" and _tokens(out, "train").tolist() == [69999, 65536, 7, 70000, 65535, 1, 70000], m

    cfg = DataConfig(path=str(out))
    assert _start_error(cfg) is None
    shard = out / "train-00000.bin"
    good = shard.read_bytes()
    for bad, what in ((good + b"\0", "one byte too many"), (good[:-4], "one token too few")):
        shard.write_bytes(bad)
        err = _start_error(cfg) or ""
        assert f"{shard}: {len(bad)} bytes, meta.json says {len(good)}; the prepared data is damaged" in err, what
    shard.write_bytes(good)


def test_a_process_waiting_for_an_unshared_cache_says_so_after_the_wait(tmp_path, monkeypatch):
    """README: the processes other than 0 wait for process 0's meta.json in data.cache_dir; when nobody
    prepares it where they look (the cache dir is not shared) they say so and stop, after a minute
    (cache.ORPHAN_WAIT_S, shortened here). While the entry's lock is held (process 0 preparing) they wait on,
    however long it takes, and take the entry once it appears."""
    import fcntl
    import threading
    import time

    from trainer.corpus import prepare

    wait = 0.3
    monkeypatch.setattr(cache, "ORPHAN_WAIT_S", wait)
    (tmp_path / "corpus.txt").write_text("a corpus of one document, long enough for a window " * 4)
    cfg = DataConfig(path=str(tmp_path / "corpus.txt"), cache_dir=str(tmp_path / "cache"))

    def waiter() -> tuple[threading.Thread, list]:
        said: list = []
        t = threading.Thread(target=lambda: said.append(_start_error(cfg, process=1)), daemon=True)
        t.start()
        return t, said

    t, said = waiter()  # nobody prepares: process 1 gives up, saying why
    t.join(timeout=60 * wait)
    assert said and "data.cache_dir must be shared by all processes" in (said[0] or ""), said

    source = sources.open_source(cfg.path, text_field="text", default_corpus_mb=0)
    dest = cache.entry(cfg, source)
    lock = cache._lock(dest, fcntl.LOCK_EX)  # process 0 is preparing
    t, said = waiter()
    time.sleep(4 * wait)
    assert t.is_alive() and not said, said  # still waiting, four times past the limit: the lock is held
    plan = prepare.Plan(source, "bytes", Fraction(0))
    prepare.prepare(plan, dest.with_name("tmp-by-process-0"))
    os.rename(dest.with_name("tmp-by-process-0"), dest)
    os.close(lock)
    t.join(timeout=60 * wait)
    assert said == [None], said  # took the entry process 0 wrote
