"""What each process can restore from, and the restore candidates the group can assemble from it: the local
copies a process holds on its node, the view of both tiers it shares with the group (trainer.ckpt.tiers
gathers one per process), and the pure choice of the candidates from the gathered views.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trainer.store.ckpt_files import DURABLE, LOCAL, STATE


@dataclass(frozen=True)
class Copy:
    """One local copy of a step on this node: the shards of process `of`, in the local tier's folder `folder`,
    as item `item` (STATE: the folder's own process's shards; BUDDY: those it holds for another process)."""

    step: int
    of: int
    folder: str
    item: str


@dataclass(frozen=True)
class Holdings:
    """What one process can restore from: the durable tier's steps, the local copies on its node, its node.
    Shared with the group as one JSON object; `to_json` and `from_json` are the one place of that form."""

    durable: tuple[int, ...]
    local: tuple[Copy, ...]
    node: str

    def to_json(self) -> dict:
        return {DURABLE: list(self.durable), LOCAL: [dataclasses.asdict(c) for c in self.local], "node": self.node}

    @classmethod
    def from_json(cls, view: dict) -> Holdings:
        return cls(tuple(view[DURABLE]), tuple(Copy(**c) for c in view[LOCAL]), view["node"])


@dataclass(frozen=True)
class Source:
    """Where one process's shards come from in a local restore: `copy`, read by process `holder` on `node`."""

    copy: Copy
    holder: int
    node: str


@dataclass(frozen=True)
class Candidate:
    """A step the group can assemble: a durable one every process lists, or a local one whose `plan` gives,
    for each process (by index), the copy its shards come from."""

    step: int
    tier: str
    plan: dict[int, Source] = dataclasses.field(default_factory=dict)


def candidates(views: list[Holdings]) -> list[Candidate]:
    """Every step the group can assemble from its processes' views (in process order): a local step needs a
    copy of every process's shards somewhere in the group."""
    durable = set.intersection(*(set(v.durable) for v in views))
    out = [Candidate(s, DURABLE) for s in durable]
    for step in {c.step for v in views for c in v.local}:
        plan = {}
        for t in range(len(views)):
            claims = [(p, c) for p, v in enumerate(views) for c in v.local if (c.step, c.of) == (step, t)]
            if not claims:
                break
            # Its own process first (no transfer), then its own copy over a held one, then the lowest index.
            p, c = min(claims, key=lambda pc: (pc[0] != t, pc[1].item != STATE, pc[0]))
            plan[t] = Source(c, p, views[p].node)
        else:
            out.append(Candidate(step, LOCAL, plan))
    return out
