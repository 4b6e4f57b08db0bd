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

import math
import numbers
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
        """None when ``entries`` hold no underflow state (an earlier version's, or saved before any update).

        Raises ValueError for entries this version never writes (a missing key, a wrong type, a NaN or
        negative ceiling, a negative count, a non-finite measurement): loaded, they would silently stop the
        policy (a NaN ceiling forbids every growth) or show nonsense in ``scaler.stats``.
        """
        if CEILING not in entries:
            return None
        try:
            last = entries.get(LAST)
            saved = cls(
                float(entries[CEILING]),
                _count(entries[SAMPLES]),
                _count(entries[GROWTHS]),
                _count(entries[NEXT_SAMPLE_IN], signed=True),
                Measurement.from_plain(last) if last is not None else None,
            )
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as error:
            raise ValueError(f"{type(error).__name__}: {error}") from None
        if not saved.ceiling > 0:
            raise ValueError(f"{CEILING} {saved.ceiling!r}")
        if saved.last is not None and not _plausible(saved.last):
            raise ValueError(f"{LAST} {last!r}"[:200])
        return saved

    def restore(self, state: ScaleState, steps: int, every: int) -> None:
        """Into ``state`` (its sample in flight, if any, dropped by the caller); ``steps``: the loaded counter;
        ``every``: this run's ``AMPGUARD_UNDERFLOW_EVERY``, the furthest the next sample may be."""
        state.ceiling, state.samples, state.growths = self.ceiling, self.samples, self.growths
        state.next_sample = steps + min(self.next_sample_in, every)
        state.last = self.last
        state.pending, state.pending_skipped, state.pending_held = None, False, False


def _count(value: Any, *, signed: bool = False) -> int:
    """An integer entry (an integral float too); negative only where ``signed``."""
    if isinstance(value, bool):  # (an Integral to Python, never one of these counts)
        raise ValueError(f"not an integer: {value!r}")
    if isinstance(value, numbers.Integral) or (isinstance(value, float) and value.is_integer()):
        count = int(value)
    else:
        raise ValueError(f"not an integer: {value!r}")
    if count < 0 and not signed:
        raise ValueError(f"negative: {value!r}")
    return count


def _plausible(measurement: Measurement) -> bool:
    """A finite positive scale, counts that are not negative, finite peaks."""
    counts = (measurement.total, *measurement.modules.values())
    return (
        math.isfinite(measurement.scale)
        and measurement.scale > 0
        and all(min(c.values, c.zeros, c.low, c.below_normal, c.sunk) >= 0 and math.isfinite(c.peak) for c in counts)
    )
