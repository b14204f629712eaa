"""The loop's flags: what this process was asked (`Flags`: by its SIGTERM handler and its monitors) and
what the whole group acts on at one step (`Shared`, agreed through trainer.parallel.agree)."""

from __future__ import annotations

import dataclasses

from trainer.observe.alerts import Do
from trainer.parallel import agree


@dataclasses.dataclass
class Flags:
    """What changes while the loop runs: set by the SIGTERM handler and by monitors' actions."""

    stop: bool = False  # SIGTERM: finish the step, save, exit PREEMPTED
    save_now: str = ""  # a monitor asked for a checkpoint now (e.g. rising ECC count): its reason
    spike: dict | None = None  # a monitor found a loss spike: exit SPIKE for the runbook
    hold_asked: bool = False  # a monitor asked to freeze updates while it probes a spike
    hold: bool = False  # the group agreed to hold: updates frozen (LR scale 0), no saves
    lr_scale_now: float = 1.0  # the LR scale in the device state (hold and nan/spike faults change it)

    def act(self, step: int, action: dict) -> None:
        """Monitors answer with {"do": one of trainer.observe.alerts.Do, ...}; the loop carries it out."""
        if action[Do.KEY] == Do.CHECKPOINT_NOW:
            self.save_now = action.get("reason", "requested")
        elif action[Do.KEY] == Do.SPIKE:
            self.spike = dict(action, step=step)
        elif action[Do.KEY] == Do.HOLD:
            self.hold_asked = True


@dataclasses.dataclass(frozen=True)
class Shared:
    """What every process of the group acts on at the same step (agreed through trainer.parallel.agree; the
    field order is the wire format)."""

    spike: bool = False  # a monitor found a loss spike: exit SPIKE for the runbook
    stop: bool = False  # SIGTERM on some process: save and exit PREEMPTED
    save_now: bool = agree.one_shot(doc="a monitor asked for a checkpoint now")
    timed: bool = agree.one_shot(doc="the durable tier's time schedule is due")
    hold: bool = False  # freeze updates while a spike is probed
    local_timed: bool = agree.one_shot(doc="the local tier's time schedule is due")
    failed: bool = False  # a durable save failed: exit STORAGE
