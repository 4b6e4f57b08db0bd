"""When measured underflow grows the loss scale, and the state that decision keeps per scaler.

The rule (:func:`decide`): grow by the scaler's growth factor, without waiting
for the growth interval, when

* the sampled step lost more than :data:`MATERIAL` of its float16 gradients'
  norm (:attr:`~ampguard.underflow.counts.Measurement.lost_norm_share`: the
  values lost, exact zeros where float32 holds the value, against all of them;
  subnormal values are kept, with fewer bits, and a run whose gradients are
  mostly subnormal trains as float32 does: docs/underflow.md's XTTS tables;
  values lost far below the others, a confident softmax's, change no update);
* its largest gradient, grown, stays :data:`HEADROOM` times below float16's
  65,504 (``peak * growth_factor * HEADROOM <= 65504``);
* the grown scale stays below the last scale that overflowed (:attr:`ScaleState.ceiling`),
  until torch's own schedule has grown past it, and within the scaler's cap.

An overflow still backs off as torch's rule says. While the rule grows the
scale, the next step is sampled too; otherwise every ``AMPGUARD_UNDERFLOW_EVERY``
steps. A run whose measured loss stays below :data:`MATERIAL` is never
touched: torch's schedule, torch's results. docs/underflow.md has the
measurements behind the two numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ampguard.underflow.counts import FLOAT16_MAX, Measurement, Transfer
from ampguard.underflow.measure import Sampler

# Share of the float16 gradients' norm lost above which underflow is material. The 2-block attention net at
# factor 1 loses none at scale 1024 and trains as in float32 (torch-identical schedule kept); at loss x 1e-8 it
# loses nearly all of it at 1024 (docs/underflow.md).
MATERIAL = 0.01
# The largest gradient after growing stays this far below 65,504: room for a gradient 64x the sampled peak.
HEADROOM = 64.0


def has_headroom(peak: float, growth_factor: float) -> bool:
    """Whether the largest sampled gradient, grown, stays :data:`HEADROOM` times below float16's largest."""
    return math.isfinite(peak) and peak * growth_factor * HEADROOM <= FLOAT16_MAX


def decide(
    scale: float, growth_factor: float, measurement: Measurement, ceiling: float = math.inf, cap: float = math.inf
) -> bool:
    """Whether the measured underflow grows ``scale`` now (see the module's docstring).

    ``measurement`` ran at ``measurement.scale``; its peak is taken to ``scale``
    (torch's update may have grown or halved the scale since). ``cap``: the
    largest scale allowed (``AMPGUARD_MAX_SCALE``).
    """
    if measurement.total.values == 0 or measurement.scale <= 0:
        return False
    peak = measurement.total.peak * scale / measurement.scale
    return (
        measurement.lost_norm_share > MATERIAL
        and has_headroom(peak, growth_factor)
        and scale * growth_factor < ceiling
        and scale * growth_factor <= cap
    )


@dataclass
class ScaleState:
    """One scaler's sampling schedule and what the policy remembers."""

    next_sample: int = 0  # the optimizer step to sample next (0: the step after the first update)
    ceiling: float = math.inf  # the last scale that overflowed, until torch's schedule grows past it
    samples: int = 0
    growths: int = 0
    last: Measurement | None = None
    sampler: Sampler = field(default_factory=Sampler)
    sampled_at: float = 0.0  # the host's scale when the sample was armed (host mode)
    armed_for_step: bool = False  # the schedule armed the sampler for this iteration (it may have disarmed itself)
    retaking: bool = False  # (ranks training one model) the step sampled now retakes one in which no rank counted
    pending: Transfer | None = None  # a sample's counts on their way to the host
    pending_skipped: bool = False  # (host mode) its step was skipped
    pending_held: bool = False  # (device mode) a non-finite loss of its step kept the scale
    pending_device: bool = False  # it was finished by a device-mode update (its counts carry that row)
    pending_shared: bool = False  # ranks training one model: its totals are the ranks' (agreed), acted on in step
    last_agreed: bool = False  # the sample taken last had the ranks' totals (an exchange may fail)

    def take(self) -> Transfer:
        """The sample on its way, now acted on."""
        pending = self.pending
        assert pending is not None
        self.pending, self.last_agreed = None, pending.agreed
        return pending

    def note_scale(self, scale: float, overflowed: bool, backoff_factor: float) -> None:
        """After an update: an overflow sets the ceiling; growing to it by torch's schedule lifts it."""
        if overflowed:
            self.ceiling = scale / backoff_factor if backoff_factor > 0 else scale
        elif scale >= self.ceiling:
            self.ceiling = math.inf
