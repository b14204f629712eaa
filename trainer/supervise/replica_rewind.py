"""The supervisor's half of the replica check: when the worker exits REPLICA_MISMATCH (data-parallel copies
of the params diverged: silent data corruption), move every durable checkpoint newer than the last step
whose replicas agreed aside, like the runbook's rewind but skipping no data, and restart from the newest
one left (the worker verifies its contents before using it). The worker's half: trainer.core.replicas.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from trainer.observe import events, rundir
from trainer.observe.event_names import REPLICA_MISMATCH, REPLICA_REWIND
from trainer.supervise import runbook


def rewind(run_dir: Path, write_event: Callable[..., None], *, tag: int) -> str:
    """Rewind after a mismatch; returns the line the supervisor prints. Every save was preceded by a replica
    check that passed, so normally nothing is newer than `last_good`; anything that is, goes aside."""
    e = events.from_last_worker(Path(run_dir) / rundir.EVENTS, REPLICA_MISMATCH)
    if e is None:
        return "replica mismatch reported without a replica_mismatch event: restarting from the newest checkpoint"
    target, moved = runbook.rewind(run_dir, e["last_good"] + 1, f"replica{tag}")
    odd = [d["device"] for d in e.get("devices", []) if d.get("odd")]
    write_event(
        REPLICA_REWIND,
        step=e["step"],
        to=target,
        moved=moved,
        last_good=e["last_good"],
        param=e.get("param"),
        devices=odd,
    )
    return (
        f"replicas of {e.get('param')} diverged at step {e['step']} (devices {odd}): silent data corruption; "
        f"rewinding to the checkpoint at step {target}" + (f", set aside {moved}" if moved else "")
    )
