"""Data: the global order is a pure function of (seed, step, skips); processes read disjoint slices."""

from __future__ import annotations

import numpy as np
import pytest

from trainer.config import DataConfig
from trainer.core.data import TokenWindows, batch_index, make_iterator, prepare


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
    it = make_iterator(cfg, corpus=corpus, seq_len=32, steps=steps, seed=seed, process=process,
                       processes=processes, skips=list(skips))
    it.set_state({"next_index": start})
    return [next(it) for _ in range(steps - start)]


def test_prepare_is_cached_and_fingerprinted(corpus, tmp_path):
    again = prepare(DataConfig(path=str(corpus.tokens_path.parents[2]), cache_dir=str(corpus.tokens_path.parents[1])))
    assert again.fingerprint == corpus.fingerprint and again.n_tokens == corpus.n_tokens
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
    n = len(TokenWindows(corpus.tokens_path, 32))
    windows = TokenWindows(corpus.tokens_path, 32)
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


def test_shuffle_off_reads_windows_in_order(corpus):
    batches = _ids(corpus, shuffle=False, steps=2)
    windows = TokenWindows(corpus.tokens_path, 32)
    assert (batches[1]["tokens"][0] == windows[8]).all()
