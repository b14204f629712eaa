"""How the processes of a group agree on the loop's flags (stop, save now, spike, hold) without a device
collective in the hot loop: through the jax coordination service's key-value store, with a fixed lag.

At step n every process publishes its flags; every process acts at step n + LAG on the OR of everyone's
step-n flags, so all of them save, stop, exit or hold at the same step. Publishing costs one counter
increment; reading step n - LAG's verdict one get that is already answered in steady state (the step's
own collectives keep processes within a step of each other). A single process has no lag.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

LAG = 2  # steps from a flag raised on any process to every process acting on it
NAMESPACE = "trainer/agree"


Flags = TypeVar("Flags")


def one_shot(*, doc: str = "") -> Any:
    """A dataclass field of a flags class that is a request, not a level (see Agreement)."""
    return dataclasses.field(default=False, metadata={"one_shot": True, "doc": doc})


class Agreement:
    """`exchange(step, flags)` -> the flags every process acts on at this step. `flags` is an instance of a
    dataclass of booleans (its field order is the wire format).

    Fields declared with `one_shot()` are requests that stay raised until served (a checkpoint-now, a timed
    save): they are published once per rising edge, so a request served LAG steps later is served once.
    The others are levels (stop, spike, hold): acting on them again changes nothing."""

    def __init__(self, kind: type, *, processes: int, start: int, timeout_s: float = 3600.0):
        fields = dataclasses.fields(kind)
        self.kind, self.names = kind, [f.name for f in fields]
        self.processes, self.start, self.n = processes, start, len(fields)
        self.lag = LAG if processes > 1 else 0
        self.one_shot = {i for i, f in enumerate(fields) if f.metadata.get("one_shot")}
        self.timeout_ms = int(timeout_s * 1000)
        self._prev = [False] * self.n
        self._client = None
        if processes > 1:
            from trainer.parallel.distributed import coordination_client

            self._client = coordination_client()

    def exchange(self, step: int, flags: Flags) -> Flags:
        return self.kind(**dict(zip(self.names, self._exchange(step, [bool(getattr(flags, n)) for n in self.names]))))

    def _exchange(self, step: int, flags: list[bool]) -> list[bool]:
        raised = [f and not (i in self.one_shot and self._prev[i]) for i, f in enumerate(flags)]
        self._prev = list(flags)
        if self._client is None:
            return raised
        self._publish(step, raised)
        due = step - self.lag
        if due <= self.start:  # the first LAG steps of an attempt act on nothing: the same on every process
            return [False] * self.n
        verdict = self._client.blocking_key_value_get(f"{NAMESPACE}/{due}/all", self.timeout_ms)
        if due - self.lag - 1 > self.start and self._is_first():
            # Everyone has published `due`, so everyone is past reading `due - LAG`: older keys are dead.
            self._client.key_value_delete(f"{NAMESPACE}/{due - self.lag - 1}")
        return [c == "1" for c in verdict]

    def _publish(self, step: int, raised: list[bool]) -> None:
        key = f"{NAMESPACE}/{step}"
        if any(raised):  # rare: a flag key first, then the count that makes it visible
            self._client.key_value_set(f"{key}/flags/{self._process()}", "".join("01"[f] for f in raised))
        if self._client.key_value_increment(key, 1) == self.processes:  # the last one in writes the verdict
            seen = [v for _, v in self._client.key_value_dir_get(f"{key}/flags/")]
            verdict = "".join("1" if any(v[i] == "1" for v in seen) else "0" for i in range(self.n))
            self._client.key_value_set(f"{key}/all", verdict)

    @staticmethod
    def _process() -> int:
        import jax

        return jax.process_index()

    def _is_first(self) -> bool:
        return self._process() == 0
