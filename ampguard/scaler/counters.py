"""What a SafeGradScaler keeps on the host beyond torch's own attributes: one object, ``scaler._counters``.

The scaler's modules (accounting, ledger, policy, crashes, checkpoint) read and
write these fields; nothing outside :mod:`ampguard.scaler` does. ``scaler.stats``
is the public snapshot of them (:class:`ampguard.stats.counters.ScalerStats`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ampguard.errors import ScaleCollapseError


@dataclass
class Counters:
    # what scaler.stats reports
    steps: int = 0  # optimizer steps requested through step()
    skipped: int = 0
    no_grad_steps: int = 0
    nonfinite_loss: int = 0
    consecutive: int = 0  # iterations skipped in a row, up to now
    min_seen: float = 0.0
    max_seen: float = 0.0
    # the float32 mirror of the scale and its growth tracker (torch's rule replayed on the host); None: on the device
    mirror_scale: float | None = None
    mirror_tracker: int = 0
    # the periodic stats line
    next_report: int = 0
    skipped_at_last_report: int = 0
    # reports made once per episode
    collapse_reported: bool = False
    stall_reported: bool = False
    stall_error: ScaleCollapseError | None = None  # raised by update() with AMPGUARD_ON_STALL=raise
    warned_no_grad: set[int] = field(default_factory=set)  # ids of optimizers already reported
    warned_fp16: bool = False
    # the last update(): ids of the optimizers stepped, and whether any skipped (None: still on the device)
    last_stepped: frozenset[int] = frozenset()
    last_skipped: bool | None = False
    # device mode (fused optimizers): the counters kept on the device (ampguard.scaler.ledger.DeviceLedger)
    ledger: Any = None

    @classmethod
    def at_start(cls, scale: float, stats_every: int | None) -> Counters:
        """A new scaler's: ``scale`` is its initial scale, the first stats line due at ``stats_every`` steps."""
        return cls(mirror_scale=scale, min_seen=scale, max_seen=scale, next_report=stats_every or 0)

    def for_pickle(self) -> Counters:
        """A copy without what belongs to this process only: the ids of optimizers, a pending error."""
        return dataclasses.replace(self, last_stepped=frozenset(), stall_error=None, warned_no_grad=set())


# The attribute each field had on the scaler itself up to 0.1.0 (pickles made by it carry these).
_EARLIER_ATTRIBUTES = {
    "_steps": "steps",
    "_skipped": "skipped",
    "_no_grad_steps": "no_grad_steps",
    "_nonfinite_loss": "nonfinite_loss",
    "_consecutive": "consecutive",
    "_min_seen": "min_seen",
    "_max_seen": "max_seen",
    "_mirror_scale": "mirror_scale",
    "_mirror_tracker": "mirror_tracker",
    "_next_report": "next_report",
    "_skipped_at_last_report": "skipped_at_last_report",
    "_collapse_reported": "collapse_reported",
    "_stall_reported": "stall_reported",
    "_stall_error": "stall_error",
    "_warned_no_grad": "warned_no_grad",
    "_warned_fp16": "warned_fp16",
    "_last_stepped": "last_stepped",
    "_last_skipped": "last_skipped",
    "_ledger": "ledger",
}


def from_earlier_attributes(state: dict[str, Any]) -> Counters:
    """The counters of a scaler pickled when they were attributes of its own (0.1.0), popped from ``state``."""
    values = {name: state.pop(attribute) for attribute, name in _EARLIER_ATTRIBUTES.items() if attribute in state}
    counters = Counters(**values)
    counters.last_stepped, counters.stall_error, counters.warned_no_grad = frozenset(), None, set()
    return counters


def counters_of(scaler: Any) -> Counters | None:
    """The counters of a SafeGradScaler (None for another scaler): for the features that react to its steps."""
    counters = getattr(scaler, "_counters", None)
    return counters if isinstance(counters, Counters) else None
