"""One scaler's underflow state in its checkpoint, its pickle and its deep copy.

The entries of ``scaler.state_dict()["ampguard"]`` (and of a pickled scaler,
:mod:`ampguard.scaler.checkpoint`), all plain Python numbers, strings, lists
and dicts, which a ``weights_only=True`` load takes:

===========================  ==================================================================
``underflow_ceiling``        the last scale that overflowed (``inf``: none, or grown past it)
``underflow_samples``        steps sampled
``underflow_growths``        growths made for underflow
``underflow_next_sample_in`` the step to sample next, counted from the scaler's step counter
``underflow_last``           the last measurement (:meth:`~ampguard.underflow.counts.Measurement.as_plain`)
===========================  ==================================================================

A resumed run keeps its ceiling (it does not grow straight back into the
overflow it backed off from), its counters and its ``scaler.stats``. A sample
whose counts were still on their way to the host when saved (CUDA) is not
waited for: the loaded scaler samples its next step instead. A checkpoint
without these entries (an earlier ampguard's, torch's) leaves the state as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ampguard.underflow.counts import Measurement
from ampguard.underflow.policy import ScaleState

CEILING = "underflow_ceiling"
SAMPLES = "underflow_samples"
GROWTHS = "underflow_growths"
NEXT_SAMPLE_IN = "underflow_next_sample_in"
LAST = "underflow_last"


def entries(state: ScaleState, steps: int) -> dict[str, Any]:
    """``state`` as plain data; ``steps``: the scaler's step counter now."""
    # a sample armed for the next step, or one whose counts are on their way (CUDA): the resumed run samples its next
    next_sample_in = 1 if state.pending is not None or state.sampler.armed else state.next_sample - steps
    saved: dict[str, Any] = {
        CEILING: float(state.ceiling),
        SAMPLES: state.samples,
        GROWTHS: state.growths,
        NEXT_SAMPLE_IN: next_sample_in,
    }
    if state.last is not None:
        saved[LAST] = state.last.as_plain()
    return saved


@dataclass(frozen=True)
class Saved:
    """The underflow entries of a loaded state, checked."""

    ceiling: float
    samples: int
    growths: int
    next_sample_in: int
    last: Measurement | None

    @classmethod
    def parse(cls, entries: dict[str, Any]) -> Saved | None:
        """None when ``entries`` hold no underflow state (an earlier version's, or saved before any update)."""
        if CEILING not in entries:
            return None
        last = entries.get(LAST)
        return cls(
            float(entries[CEILING]),
            int(entries[SAMPLES]),
            int(entries[GROWTHS]),
            int(entries[NEXT_SAMPLE_IN]),
            Measurement.from_plain(last) if last is not None else None,
        )

    def restore(self, state: ScaleState, steps: int) -> None:
        """Into ``state`` (its sample in flight, if any, dropped by the caller); ``steps``: the loaded counter."""
        state.ceiling, state.samples, state.growths = self.ceiling, self.samples, self.growths
        state.next_sample = steps + self.next_sample_in
        state.last = self.last
        state.pending, state.pending_skipped, state.pending_held = None, False, False
