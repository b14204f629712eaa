"""Who holds whose fast-tier copy (trainer.ckpt.buddy): pure functions, no processes. The transfers themselves
run for real in tests/test_integrity.py (two processes) and tests/test_node_loss.py (a three-node SLURM)."""

from __future__ import annotations

from trainer.ckpt import buddy


def test_every_copy_goes_to_another_node_at_the_same_local_rank():
    # One process per node: each to the next node, cyclically.
    assert buddy.pair(["a", "b", "c"]).to == [1, 2, 0]
    # Two per node, in whatever order the process indices fall: the next node's process of the same rank.
    assert buddy.pair(["a", "a", "b", "b"]).to == [2, 3, 0, 1]
    assert buddy.pair(["b", "a", "b", "a"]).to == [1, 0, 3, 2]
    # One node: a copy on the same disk survives nothing more. Uneven nodes where a copy would stay home: none.
    assert buddy.pair(["a", "a"]) is None
    assert buddy.pair(["a", "a", "a", "b"]) is None
    for nodes in (["a", "b", "c"], ["a", "a", "b", "b"], ["x", "y", "x", "y", "z", "z"]):
        to = buddy.pair(nodes).to
        assert sorted(to) == list(range(len(nodes)))  # a permutation: a transfer is one collective permute
        assert all(nodes[i] != nodes[to[i]] for i in range(len(nodes)))


def test_restore_transfers_never_ask_one_process_to_give_twice_in_a_round():
    # Process 0 holds the shards of 1 and 2 (both lost): two rounds; process 3 has its own (no transfer).
    assert list(buddy.rounds({0: 0, 1: 0, 2: 0, 3: 3})) == [{1: 0}, {2: 0}]
    assert list(buddy.rounds({0: 1, 1: 0})) == [{0: 1, 1: 0}]  # a swap is one round
    assert buddy.complete({1: 0}, 3) == {0: 1, 1: 0, 2: 2}  # the free processes fill the permutation
