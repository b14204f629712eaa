"""The supervisor's half of the replica check: when the worker exits REPLICA_MISMATCH (data-parallel copies
of the params diverged: silent data corruption), move every durable checkpoint newer than the last step
whose replicas agreed aside, like the runbook's rewind but skipping no data, and restart from the newest
one left (the worker verifies its contents before using it). The worker's half: trainer.train.replicas.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from trainer.observe import events
from trainer.store import rundir
from trainer.store.event_names import REPLICA_MISMATCH, REPLICA_REWIND
from trainer.supervise import runbook


def rewind(
    run_dir: Path, write_event: Callable[..., None], *, tag: int, nodes: list[str]
) -> tuple[str, tuple[str, str] | None]:
    """Rewind after a mismatch; returns the line the supervisor prints and the (node, why) to blame: the node
    of the process whose copies disagreed with the majority of the replicas (none when there is no majority,
    as with two replicas: either may be the bad one). Every save was preceded by a replica check that passed,
    so normally nothing is newer than `last_good`; anything that is, goes aside. `nodes`: each process's."""
    e = events.from_last_worker(Path(run_dir) / rundir.EVENTS, REPLICA_MISMATCH)
    if e is None:
        line = "replica mismatch reported without a replica_mismatch event: restarting from the newest checkpoint"
        return line, None
    target, moved = runbook.rewind(run_dir, e["last_good"] + 1, f"replica{tag}")
    devices = e.get("devices", [])
    odd = [d["device"] for d in devices if d.get("odd")]
    odd_processes = {d["process"] for d in devices if d.get("odd")}
    culprit = None
    if len(odd) < len(devices) and len(odd_processes) == 1 and (p := odd_processes.pop()) < len(nodes) and nodes[p]:
        why = f"its replica of {e.get('param')} (process {p}) disagreed with the others at step {e['step']}"
        culprit = (nodes[p], why)
    write_event(
        REPLICA_REWIND,
        step=e["step"],
        to=target,
        moved=moved,
        last_good=e["last_good"],
        param=e.get("param"),
        devices=odd,
        **({"node": culprit[0]} if culprit else {}),
    )
    line = (
        f"replicas of {e.get('param')} diverged at step {e['step']} (devices {odd}): silent data corruption; "
        f"rewinding to the checkpoint at step {target}" + (f", set aside {moved}" if moved else "")
    )
    return line, culprit
