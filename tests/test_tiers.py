"""The two checkpoint tiers' rules, on real Orbax checkpoints in this process (no training, < 1 s each):
which checkpoint a restore takes across the durable and the node-local tier (a tie, another mesh or
process count, a history the runbook rewound away from), `checkpoint.verify=false`, and a checkpoint that
verifies but does not load. The local tier end to end: tests/test_integrity.py (kills, lost nodes, copies
held by a peer, a full local disk)."""

from __future__ import annotations

from pathlib import Path

from trainer.store import ckpt_files as checkpoint_files
from trainer.store import event_names as E
from trainer.store import manifest
from trainer.store.ckpt_files import DURABLE, LOCAL

MESH = {"data": 2, "fsdp": 2, "tensor": 2}  # a local copy records the mesh it was saved under; compared as is


def tiers(run: Path, local: Path | None = None, *, rewinds=(), verify: bool = True, log: list | None = None):
    """A run's Tiers as the worker makes them (one per attempt); `log` collects the events."""
    from trainer.ckpt.tiers import Tiers
    from trainer.config import CheckpointConfig

    cfg = CheckpointConfig(local_dir=str(local or ""), verify=verify)
    write = (lambda name, **fields: log.append(dict(fields, event=name))) if log is not None else lambda *a, **k: None
    return Tiers(run, cfg, log=write, pinned=None, rewinds=list(rewinds))


def save(t, step: int, tier: str, *, size: int = 8) -> None:
    """A state whose values say which step and tier wrote it (x.0 durable, x.5 local): a restore's values,
    not only its event, show where it read from."""
    import jax.numpy as jnp

    value = step + (0.5 if tier == LOCAL else 0.0)
    t.save(step, {"w": jnp.full(size, value)}, {"next_index": step}, {"mesh": MESH, "processes": 1}, tier=tier)


def restore(t, *, mesh: dict = MESH, processes: int = 1) -> tuple[int, str, float] | str | None:
    """(step, tier, the value read) of what a worker with this mesh and process count restores, None (no
    checkpoint: a fresh start), or the error the restore raised (so the assertion on its choice says so)."""
    import jax
    import jax.numpy as jnp

    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = {"w": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=one)}
    try:
        r = t.restore_newest(abstract, layout={"processes": processes, "mesh": mesh})
    except Exception as e:
        return f"raised {e!r}"
    return r and (r.step, r.tier, float(r.state["w"][0]))


def test_at_the_same_step_the_local_copy_is_restored(tmp_path):
    run, local = tmp_path / "run", tmp_path / "local"
    t = tiers(run, local)
    save(t, 10, DURABLE)
    save(t, 10, LOCAL)
    t.close()
    assert restore(tiers(run, local)) == (10, LOCAL, 10.5)  # local first at equal steps: it reads fastest


def test_a_local_copy_is_used_only_with_the_mesh_and_process_count_it_was_saved_under(tmp_path):
    """A local copy holds one process's shards as laid out by one mesh: under another it would not assemble
    the state (Orbax reshards only the durable tier's global arrays)."""
    run, local = tmp_path / "run", tmp_path / "local"
    t = tiers(run, local)
    save(t, 10, DURABLE)
    save(t, 12, LOCAL)
    t.close()
    t = tiers(run, local)
    assert restore(t) == (12, LOCAL, 12.5)  # the same mesh and process count: the newer local copy
    assert restore(t, mesh=dict(MESH, data=1, fsdp=4)) == (10, DURABLE, 10.0), "another mesh"
    assert restore(t, processes=2) == (10, DURABLE, 10.0), "another process count"


def test_a_local_copy_from_a_history_the_runbook_rewound_away_from_is_never_used(tmp_path):
    """The runbook's rewind moves durable checkpoints aside, but it cannot reach node-local disks: a local copy
    saved past a rewind's target before that rewind is from the abandoned history. Its own older copies,
    and copies saved after the rewind, are on the history the run follows."""
    run, local = tmp_path / "run", tmp_path / "local"
    t = tiers(run, local)
    save(t, 4, DURABLE)
    save(t, 6, LOCAL)
    save(t, 12, LOCAL)  # then a spike, and the runbook rewinds to step 8
    t.close()
    assert restore(tiers(run, local)) == (12, LOCAL, 12.5)  # no rewind: 12 is the newest
    t = tiers(run, local, rewinds=[8])
    assert restore(t) == (6, LOCAL, 6.5), "the rewound-away copy of 12 was used"
    save(t, 9, LOCAL)  # the run goes on from the rewind: a new local copy, on the new history
    t.close()
    assert restore(tiers(run, local, rewinds=[8])) == (9, LOCAL, 9.5), "a copy saved after the rewind was passed over"


def test_verify_false_writes_no_manifests_and_restores_without_them_verify_true_requires_them(tmp_path):
    run, local = tmp_path / "run", tmp_path / "local"
    t = tiers(run, local, verify=False)
    save(t, 5, DURABLE)
    save(t, 10, LOCAL)
    t.close()
    assert not list(tmp_path.rglob(manifest.DIR)), "a manifest was written with verify=false"
    t = tiers(run, local, verify=False)
    assert restore(t) == (10, LOCAL, 10.5), "verify=false: the local copy without manifests was not trusted"
    assert restore(t, processes=2) == (5, DURABLE, 5.0), "verify=false: the durable one was not trusted"
    # verify=true: the same checkpoints are unverified (no manifests), rejected in both tiers, set aside
    log: list[dict] = []
    assert restore(tiers(run, local, log=log)) is None
    rejected = [(e["step"], e["tier"], e["reason"].split(":")[0]) for e in log if e["event"] == E.CHECKPOINT_REJECTED]
    assert rejected == [(10, LOCAL, "unverified"), (5, DURABLE, "unverified")], log


def test_a_checkpoint_that_verifies_but_does_not_load_is_rejected_and_the_previous_one_used(tmp_path):
    """Files that match their manifests but that Orbax cannot read (here a metadata item torn before it was
    checksummed, as a faulty writer would leave it), in either tier: rejected like a bad checksum."""
    run, local = tmp_path / "run", tmp_path / "local"
    t = tiers(run, local)
    for step, tier in ((5, DURABLE), (10, DURABLE), (12, LOCAL)):
        save(t, step, tier)
    t.close()
    local12 = checkpoint_files.local_dir(str(local), run, 0, t.node) / "12"
    for step_dir, durable in ((run / "checkpoints" / "10", True), (local12, False)):
        meta = step_dir / "meta" / "metadata"
        meta.write_bytes(meta.read_bytes()[: meta.stat().st_size // 2])
        manifest.write(step_dir, process=0, processes=1, durable=durable)
        assert manifest.verify(step_dir) is None  # it verifies
    log: list[dict] = []
    assert restore(tiers(run, local, log=log)) == (5, DURABLE, 5.0), "a checkpoint that did not load was used"
    rejected = [(e["step"], e["tier"], e["reason"].split(":")[0]) for e in log if e["event"] == E.CHECKPOINT_REJECTED]
    assert rejected == [(12, LOCAL, "unreadable"), (10, DURABLE, "unreadable")], log
    assert [p.name.split("-")[0] for p in (run / checkpoint_files.REJECTED).iterdir()] == ["10"]
    assert [p.name.split("-")[1] for p in (local12.parents[1] / checkpoint_files.LOCAL_REJECTED).iterdir()] == ["12"]


def test_a_local_step_is_a_candidate_only_when_every_process_has_a_copy_somewhere():
    """The pure choice over the views the processes gather (holdings.candidates): each process's own copy
    first, else a copy another process holds for it; a step missing one process's shards is no candidate.
    The views cross as JSON and come back equal."""
    import json

    from trainer.ckpt.holdings import Candidate, Copy, Holdings, Source, candidates
    from trainer.store.ckpt_files import BUDDY, STATE

    own0, held1 = Copy(12, 0, "process_0", STATE), Copy(12, 1, "process_0", BUDDY)
    own1, partial = Copy(12, 1, "process_1", STATE), Copy(16, 0, "process_0", STATE)
    views = [Holdings((10, 20), (own0, held1, partial), "a"), Holdings((10,), (own1,), "b")]
    assert [Holdings.from_json(json.loads(json.dumps(v.to_json()))) for v in views] == views
    found = {(c.step, c.tier): c for c in candidates(views)}
    assert sorted(found) == [(10, DURABLE), (12, LOCAL)]  # 20: not on every process; 16: no copy of process 1
    assert found[12, LOCAL] == Candidate(12, LOCAL, {0: Source(own0, 0, "a"), 1: Source(own1, 1, "b")})
    lost = [views[0], Holdings((10,), (), "c")]  # process 1's node lost with its copy: process 0 serves it
    served = {0: Source(own0, 0, "a"), 1: Source(held1, 0, "a")}
    assert [c.plan for c in candidates(lost) if c.tier == LOCAL] == [served]
