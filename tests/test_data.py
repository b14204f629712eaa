"""Data: the global order is a pure function of (seed, step, skips); processes read disjoint slices."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, child_env

from trainer.config import ConfigError, DataConfig
from trainer.observe.audit import AuditLog
from trainer.observe.audit import check as audit_check
from trainer.train.data import TokenWindows, batch_index, eval_windows, make_iterator, prepare


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    # Random letters: every window's content is unique, so content identifies the window.
    rng = np.random.default_rng(0)
    (d / "a.txt").write_bytes(rng.integers(97, 123, 26000, dtype=np.uint8).tobytes())
    (d / "b.md").write_bytes(rng.integers(97, 123, 27008, dtype=np.uint8).tobytes())
    return prepare(DataConfig(path=str(d), cache_dir=str(d / "cache")))


def _ids(corpus, *, steps=8, seed=0, process=0, processes=1, skips=(), shuffle=True, start=0):
    cfg = DataConfig(batch_size=8, shuffle=shuffle, read_threads=1)
    it = make_iterator(
        cfg, corpus=corpus, seq_len=32, steps=steps, seed=seed, process=process, processes=processes, skips=list(skips)
    )
    it.set_state({"next_index": start})
    return [next(it) for _ in range(steps - start)]


def test_prepare_is_cached_and_fingerprinted(corpus, tmp_path):
    again = prepare(DataConfig(path=str(corpus.dir.parents[1]), cache_dir=str(corpus.dir.parent)))
    assert again.dir == corpus.dir and again.fingerprint == corpus.fingerprint and again.n_tokens == corpus.n_tokens
    assert corpus.n_tokens == 26000 + 27008 + 2  # bytes plus one separator per document


def test_order_is_a_pure_function_of_seed_and_step(corpus):
    a, b = _ids(corpus), _ids(corpus)
    assert all((x["tokens"] == y["tokens"]).all() and (x["ids"] == y["ids"]).all() for x, y in zip(a, b))
    other = _ids(corpus, seed=1)
    assert any((x["tokens"] != y["tokens"]).any() for x, y in zip(a, other))


def test_resuming_the_iterator_mid_way_gives_the_same_batches(corpus):
    full = _ids(corpus)
    tail = _ids(corpus, start=5)
    assert all((x["tokens"] == y["tokens"]).all() for x, y in zip(full[5:], tail))


def test_processes_read_disjoint_slices_that_cover_the_global_batch(corpus):
    whole = _ids(corpus)
    parts = [_ids(corpus, process=p, processes=2) for p in range(2)]
    for k in range(8):
        joined = np.concatenate([parts[0][k]["ids"], parts[1][k]["ids"]])
        assert set(parts[0][k]["ids"]).isdisjoint(parts[1][k]["ids"])
        assert (joined == whole[k]["ids"]).all()
        assert (np.concatenate([parts[0][k]["tokens"], parts[1][k]["tokens"]]) == whole[k]["tokens"]).all()


def test_each_epoch_visits_every_window_exactly_once(corpus):
    n = len(TokenWindows.of(corpus, 32))
    windows = TokenWindows.of(corpus, 32)
    steps = n // 8
    seen = [w.tobytes() for b in _ids(corpus, steps=steps) for w in b["tokens"]]
    assert len(set(seen)) == len(seen) == steps * 8  # no window twice
    assert set(seen) <= {windows[i].tobytes() for i in range(n)}
    second = [w.tobytes() for b in _ids(corpus, steps=2 * steps)[steps:] for w in b["tokens"]]
    assert len(set(second)) == len(second) and second != seen  # a fresh permutation each epoch


def test_skips_advance_the_cursor_past_the_listed_batches(corpus):
    assert [batch_index(k, [2, 3]) for k in range(5)] == [0, 1, 4, 5, 6]
    plain = _ids(corpus, steps=10)
    skipped = _ids(corpus, steps=8, skips=[2, 3])
    assert (skipped[2]["ids"] == plain[4]["ids"]).all() and (skipped[1]["ids"] == plain[1]["ids"]).all()


def test_the_audit_names_a_batch_that_was_never_consumed(corpus, tmp_path):
    """Real iterators logged as the worker logs them: a resume at step 5 whose cursor lands one batch late
    reads batches 6.. at steps 5..; batch 5 is trained on by no step and is on no skip list, and nothing is
    read twice, so only the "never consumed" check can see it. The same resume with its cursor right: no
    problem."""
    windows = len(TokenWindows.of(corpus, 32))

    def audited(run: Path, cursor: int) -> list[str]:
        for start, stop, at in ((0, 5, 0), (5, 10, cursor)):  # two sessions: stopped at 5, resumed
            log = AuditLog(run, process=0, processes=1, start=start, global_batch=8, epoch_windows=windows, skips=[])
            for k, batch in zip(range(start, stop), _ids(corpus, steps=12, start=at)):
                log.record(k, batch)
        return audit_check(run)[0].problems

    assert audited(tmp_path / "right", cursor=5) == []
    problems = audited(tmp_path / "late", cursor=6)
    assert problems == ["data batch 5 (samples 40..47) was never consumed and is not on the skip list"], problems


def test_shuffle_off_reads_windows_in_order(corpus):
    batches = _ids(corpus, shuffle=False, steps=2)
    windows = TokenWindows.of(corpus, 32)
    assert (batches[1]["tokens"][0] == windows[8]).all()


def test_windows_do_not_depend_on_how_the_split_is_cut_into_shards(corpus, tmp_path):
    from trainer.corpus import prepare as prep
    from trainer.corpus import sources

    src = sources.open_source(str(corpus.dir.parents[1]), text_field="text", default_corpus_mb=0)
    prep.prepare(
        prep.Plan(src, "bytes", sources.val_fraction(0.02, "v"), shard_tokens=1000), tmp_path / "cut", progress=""
    )
    cut = prepare(DataConfig(path=str(tmp_path / "cut")))  # a prepared DIR is read as it is
    assert len(cut.shards("train")) == 54 and len(corpus.shards("train")) == 1
    one, many = TokenWindows.of(corpus, 32), TokenWindows.of(cut, 32)
    assert len(one) == len(many) and all((one[i] == many[i]).all() for i in range(len(one)))  # 31 span two files
    assert cut.fingerprint != corpus.fingerprint  # other files, same stream: the data is identified by its files


def test_eval_windows_are_fixed_spread_over_the_split_and_sharded_like_training(tmp_path):
    rng = np.random.default_rng(1)
    for i in range(40):  # 40 documents; every 10th is held out
        (tmp_path / f"{i:02d}.txt").write_bytes(rng.integers(97, 123, 700, dtype=np.uint8).tobytes())
    c = prepare(DataConfig(path=str(tmp_path), cache_dir=str(tmp_path / "cache"), val_fraction=0.1))
    assert c.n_val_tokens == 4 * 701
    val = TokenWindows.of(c, 32, "val")
    whole = eval_windows(c, seq_len=32, global_batch=8, batches=3, process=0, processes=1)
    assert whole.shape == (3, 8, 33) and len(val) == 87
    picks = [(k * 87) // 24 for k in range(24)]  # evenly spread, first to last
    assert (whole.reshape(24, 33) == np.stack([val[i] for i in picks])).all()
    halves = [eval_windows(c, seq_len=32, global_batch=8, batches=3, process=p, processes=2) for p in (0, 1)]
    assert (np.concatenate(halves, axis=1) == whole).all()
    with pytest.raises(ConfigError, match="eval needs 96 validation windows .* holds out only 87"):
        eval_windows(c, seq_len=32, global_batch=8, batches=12, process=0, processes=1)


ENSURE = """
import sys
from trainer.config import DataConfig
from trainer.corpus import cache
c = cache.ensure(DataConfig(path=sys.argv[1], cache_dir=sys.argv[2], tokenizer="bpe:300"), process=int(sys.argv[3]))
print(c.dir, c.fingerprint, c.fresh)
"""


def test_a_raw_path_is_prepared_once_by_process_0_while_the_other_waits(tmp_path):
    """Two real processes start together on a cold cache: process 0 prepares, process 1 waits for it; one
    directory, one fingerprint."""
    rng = np.random.default_rng(2)
    words = np.array("def class return import self data token shard".split())
    (tmp_path / "a.txt").write_text(" ".join(rng.choice(words, 60_000)))
    cache_dir = tmp_path / "cache"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ENSURE, str(tmp_path / "a.txt"), str(cache_dir), str(p)],
            cwd=ROOT,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for p in (1, 0)
    ]  # the waiter first
    (out1, err1), (out0, err0) = (p.communicate(timeout=120) for p in procs)
    assert [p.returncode for p in procs] == [0, 0], err0 + err1
    assert out0.split()[2] == "True" and out1.split()[2] == "False"  # prepared by process 0 only
    assert out0.split()[:2] == out1.split()[:2]  # one directory, one fingerprint
    entry = Path(out0.split()[0])
    assert sorted(p.name for p in cache_dir.iterdir()) == [entry.name, entry.name + ".lock"]
    # The other order: process 1 arrives after the entry was published and reads it as it is.
    late = subprocess.run(
        [sys.executable, "-c", ENSURE, str(tmp_path / "a.txt"), str(cache_dir), "1"],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert late.returncode == 0 and late.stdout.split() == [*out0.split()[:2], "False"], late.stderr
