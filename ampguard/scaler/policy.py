"""The scale policy: torch's update rule replayed on the host, the collapse zone, collapse and stall reports.

Collapse: an overflow with the scale at the floor, or where backing off would
take it below 1, logs CRITICAL once per episode; the episode ends when the
scale grows out of that zone. Stall: ``AMPGUARD_MAX_CONSECUTIVE_SKIPS``
consecutive skipped iterations log CRITICAL once per streak, or, with
``AMPGUARD_ON_STALL=raise``, make ``update()`` raise ScaleCollapseError after
completing its iteration (never ``stats``, ``state_dict()`` or pickling).
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch

import ampguard.containment as containment
import ampguard.messages as messages
import ampguard.scaler.diagnose as diagnose
from ampguard.errors import ScaleCollapseError
from ampguard.log import event, logger
from ampguard.scaler.parts import ScalerParts
from ampguard.scaler.verdict import StepVerdict


def f32(value: float) -> float:
    """Round a Python float to float32, as torch stores the scale (inf when out of range)."""
    return ctypes.c_float(value).value


def next_scale(
    scale: float, tracker: int, found_inf: bool, growth_factor: float, backoff_factor: float, growth_interval: int
) -> tuple[float, int]:
    """The host replay of ``torch._amp_update_scale_``: float32 scale, int growth tracker."""
    if found_inf:
        return f32(scale * backoff_factor), 0
    tracker += 1
    if tracker == growth_interval:
        grown = f32(scale * growth_factor)
        return (grown if math.isfinite(grown) else scale), 0
    return scale, tracker


def forward_overflow(found_inf: bool, loss_nonfinite: bool) -> bool:
    """The one rule both modes count by: an overflow the scale did not cause.

    An iteration whose gradients overflowed while a loss itself was inf/NaN: no
    scale makes that loss finite, so the scale and the growth tracker stay. A non-finite loss with finite gradients is no overflow:
    the optimizers step and the iteration counts toward the growth interval, as
    in torch. Host mode (ampguard.scaler.accounting) and device mode's rows
    (ampguard.scaler.ledger: the rows and their host copies) ask this.
    """
    return found_inf and loss_nonfinite


@dataclass
class Alarms:
    """Collapses and stalls counted, not reported yet."""

    collapse_at: float | None = None  # the lowest scale an overflow collapsed at
    stall: int = 0  # the longest streak of skipped iterations that reached the stall limit


class ScalePolicy(ScalerParts):
    """The floor and cap, the counting of each verdict, collapse and stall reports, and a growth asked for."""

    def _count(self, verdict: StepVerdict, alarms: Alarms) -> None:
        """The one counting path: each iteration's verdict, at its update (host mode) or at the ledger's read
        (device mode, in row order): skips, non-finite losses, the scale's range, the streak; the collapses and
        stalls found go into ``alarms``, raised by :meth:`_raise_alarms` (at once in host mode, after the rows)."""
        counters = self._counters
        counters.skipped += verdict.skipped_steps
        counters.nonfinite_loss += verdict.loss_nonfinite
        counters.min_seen = min(counters.min_seen, verdict.scale_before, verdict.scale)
        counters.max_seen = max(counters.max_seen, verdict.scale_before, verdict.scale)
        if verdict.found_inf:
            counters.consecutive += 1
            if not verdict.forward_overflow and self._in_collapse_zone(verdict.scale_before):
                alarms.collapse_at = min(alarms.collapse_at or verdict.scale_before, verdict.scale_before)
            if counters.consecutive >= self._settings.max_consecutive_skips and not counters.stall_reported:
                alarms.stall = max(alarms.stall, counters.consecutive)
        else:
            counters.consecutive = 0
            counters.stall_reported = False
        if not self._in_collapse_zone(verdict.scale):
            counters.collapse_reported = False

    def _raise_alarms(self, alarms: Alarms) -> None:
        """CRITICAL for the collapse (its lowest scale) and the longest stall ``alarms`` hold, once per episode."""
        if alarms.collapse_at is not None:
            self._report_collapse(alarms.collapse_at)
            if not self._in_collapse_zone(self._counters.mirror_scale or 0.0):
                self._counters.collapse_reported = False  # it ended since (device mode): the next one is news
        if alarms.stall:
            self._counters.stall_reported = False
            self._check_stall(alarms.stall)
            self._counters.stall_reported = self._counters.consecutive >= self._settings.max_consecutive_skips

    def _torch_update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """torch's ``update()`` itself (both modes run it, then keep their books)."""
        try:  # (containment.torch_call, inlined: every update) torch's errors are torch's, not ampguard's
            super().update(new_scale)
        except Exception as error:
            raise containment.FromTorch(error) from None
        self._torch_updated = True

    def _bounded(self, scale: float) -> float:
        """``scale`` within the scaler's floor and cap."""
        return min(max(scale, self._min_scale), self._max_scale)

    def _in_collapse_zone(self, scale: float) -> bool:
        """An overflow at this scale means collapse: at the floor, or the scale would fall below 1."""
        return (self._min_scale > 0 and scale <= self._min_scale) or scale * self._backoff_factor < 1.0

    def _report_collapse(self, scale: float) -> None:
        """CRITICAL once per episode; an episode ends when the scale grows out of the collapse zone."""
        if self._counters.collapse_reported:
            return
        self._counters.collapse_reported = True
        at_floor = self._min_scale > 0 and scale <= self._min_scale
        floor = f" (the floor, AMPGUARD_MIN_SCALE={self._min_scale:g})" if at_floor else ""
        note = diagnose.parameters_note(self)  # inf/NaN parameters: the usual causes do not apply
        template = messages.SCALE_COLLAPSE_PARAMETERS if note else messages.SCALE_COLLAPSE
        logger.critical(
            template.format(step=self._counters.steps, scale=scale, floor=floor, note=note), extra=event("collapse")
        )

    def _check_stall(self, consecutive: int) -> None:
        """CRITICAL once per streak of consecutive skipped steps, or ScaleCollapseError from update()."""
        settings, counters = self._settings, self._counters
        if consecutive < settings.max_consecutive_skips or counters.stall_reported:
            return
        counters.stall_reported = True
        raising = settings.on_stall == "raise"
        message = (messages.STALL_RAISED if raising else messages.STALL).format(
            count=consecutive,
            step=counters.steps,
            scale=counters.mirror_scale if counters.mirror_scale is not None else float("nan"),
            loss=diagnose.parameters_note(self) or (messages.LOSS_WAS_NONFINITE if counters.nonfinite_loss else ""),
            limit=settings.max_consecutive_skips,
        )
        if raising:
            counters.stall_error = ScaleCollapseError(message)
        else:
            logger.critical(message, extra=event("stall"))

    def grow_now(self, below: float = math.inf) -> float | None:
        """Grow the scale by the growth factor now, within the cap and below ``below``, and restart the growth
        interval: for a capability that knows the gradients have room (ampguard.underflow).

        No host read: in host mode the mirror is grown with the device's scale and
        the new scale returned (the old one when it cannot grow); in device mode
        (no mirror) the growth is made on the device and None returned (the
        ledger's rows record it).
        """
        assert self._scale is not None and self._growth_tracker is not None
        counters = self._counters
        current = counters.mirror_scale
        if current is None:
            grown_tensor = (self._scale * self._growth_factor).clamp(max=self._max_scale)  # as _bounded() on the host
            allowed = (grown_tensor < below) & (grown_tensor > self._scale)
            self._scale.copy_(torch.where(allowed, grown_tensor, self._scale))
            self._growth_tracker.copy_(torch.where(allowed, 0, self._growth_tracker))
            return None
        grown = self._bounded(f32(current * self._growth_factor))
        if not math.isfinite(grown) or grown <= current or grown >= below:
            return current
        self._scale.fill_(grown)
        self._growth_tracker.fill_(0)
        counters.mirror_scale, counters.mirror_tracker = grown, 0
        counters.min_seen, counters.max_seen = min(counters.min_seen, grown), max(counters.max_seen, grown)
        return grown
