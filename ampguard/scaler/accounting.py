"""Host mode: the scaler's counters and its float32 mirror of the scale, riding on torch's one read.

torch's ``step()`` reads the optimizer's found_inf flag on the host once
(``_maybe_opt_step``); that read also carries "was the loss non-finite?" and the
fields of the capabilities listening to the scaler (``_step_code``,
``_note_verdict``; :mod:`ampguard.scaler.listeners`). From there ``update()`` keeps its
bookkeeping on the host (``_update_in_host_mode``): skip counts, the mirror
of the scale (torch's rule replayed, :func:`ampguard.scaler.policy.next_scale`),
the floor, the cap, collapse and stall detection. The counters are what
``scaler.stats`` shows and what the periodic stats line reports.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import torch

import ampguard.containment as containment
import ampguard.distributed as distributed
import ampguard.scaler.diagnose as diagnose
import ampguard.scaler.listeners as listeners
import ampguard.scaler.policy as policy
from ampguard.log import logger
from ampguard.scaler.ledger import DeviceBooks
from ampguard.scaler.live import TorchGradScaler
from ampguard.scaler.policy import Alarms
from ampguard.scaler.verdict import StepVerdict
from ampguard.stats.counters import ScalerStats, log_stats

try:
    from torch.amp.grad_scaler import _refresh_per_optimizer_state
except ImportError:  # a torch that renamed it: the grad_scaler patch reports itself unavailable
    _refresh_per_optimizer_state = None  # type: ignore[assignment]


class HostBooks(DeviceBooks):
    """Host mode: what torch's one read in ``step()`` tells, counted at ``update()``; ``stats``; the stats line."""

    def _step_code(self, optimizer_state: dict[str, Any]) -> tuple[torch.Tensor, listeners.Layout]:
        """found_inf (0/1), + 2 when a loss was non-finite, + the listeners' fields: one value for torch's one read."""
        found_infs = list(optimizer_state["found_inf_per_device"].values())
        total = found_infs[0]
        for other in found_infs[1:]:
            total = total + other.to(total.device, non_blocking=True)
        code = total.clamp(max=1.0) if len(found_infs) > 1 or not self._host_mirror_exact else total  # 0 or 1
        if self._iteration.loss_check is not None:
            # + 2 when a loss was non-finite (its check is NaN): still one value, one read.
            code = code + torch.nan_to_num(self._iteration.loss_check.to(code.device, non_blocking=True), nan=2.0)
        if listeners.adding_to_read:
            return listeners.encode(self._handle, code)
        return code, listeners.layout

    def _note_verdict(self, optimizer: torch.optim.Optimizer, value: int, layout: listeners.Layout) -> bool:
        """Everything the host learns from the one read; returns whether the step is skipped."""
        found = bool(value & listeners.FOUND)
        self._iteration.host_found[id(optimizer)] = found
        if value < listeners.FIELDS_START and layout is listeners.layout:
            fields = listeners.no_fields
        else:
            fields = listeners.decode(layout, value)
        for listener, field in fields.items():  # the largest of the iteration's reads
            self._iteration.fields[listener] = max(field, self._iteration.fields.get(listener, 0))
        for listener in listeners.hearing_read:
            try:
                listener.on_read(self._handle, optimizer, fields.get(listener, 0), found)
            except Exception as error:
                listeners.failed(listener, "step()", error)
        if value & listeners.LOSS_NONFINITE:
            self._iteration.loss_nonfinite = True
        if found:
            diagnose.on_skipped_step(self, optimizer, loss_nonfinite=bool(value & 2), step=self._counters.steps + 1)
        return found

    def _update_books(self, new_scale: float | torch.Tensor | None) -> None:
        """``update()`` of an enabled scaler: host mode, device mode, or torch's own when ampguard's bookkeeping fails."""
        states = self._per_optimizer_states
        self._torch_updated = False
        self._iteration.scale_given = new_scale is not None
        try:
            mode = "device" if new_scale is not None else self._update_mode(states)
            if mode == "nothing":
                self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)  # no inf checks: scale kept
                self._counters.last_stepped, self._counters.last_skipped = frozenset(), False
            elif mode == "host":
                self._update_in_host_mode()
            else:
                self._update_in_device_mode(states, new_scale)
        except Exception as error:
            passing = containment.passes_through(error)
            if passing is not None:
                raise passing from None
            containment.report("scale bookkeeping (update())", error)
            if not self._torch_updated:  # torch's update if it did not run, then the device's truth
                TorchGradScaler.update(self, new_scale)
            self._resync_mirror()

    def _update_mode(self, states: dict[int, dict[str, Any]]) -> str:
        """``"nothing"``: no optimizer recorded found_inf this iteration (torch's "inf checks"); ``"host"``: every
        one that did was read on the host (no fused one, no ledger pending); else ``"device"``."""
        host_found = self._iteration.host_found
        recorded = False
        for key, state in states.items():  # (a loop: no generator frame on a healthy update)
            if state["found_inf_per_device"]:
                if key not in host_found:
                    return "device"
                recorded = True
        if not recorded:
            return "nothing"
        return "host" if self._counters.ledger is None and self._host_mirror_exact else "device"

    def _update_in_host_mode(self) -> None:
        found = any(self._iteration.host_found.values())
        forward_overflow, fields = False, self._iteration.fields
        if found:  # was a loss itself inf/NaN, on any rank? (an exchange under torch.distributed, else free)
            loss_nonfinite, agreed = distributed.agree_on_skip(self._iteration.loss_nonfinite, list(fields.values()))
            forward_overflow = policy.forward_overflow(found, loss_nonfinite)
            fields = dict(zip(fields, agreed))
        skipped_steps = sum(self._iteration.host_found.values())
        scale_before = self._counters.mirror_scale
        assert scale_before is not None
        self._torch_update()
        # A forward overflow (the loss itself inf/NaN) was not the scale's doing, and its step taught nothing about
        # the gradients: the scale and the growth tracker stay as they were, written over torch's back-off.
        scale, tracker = scale_before, self._counters.mirror_tracker
        if not forward_overflow:
            scale, tracker = policy.next_scale(
                scale, tracker, found, self._growth_factor, self._backoff_factor, self._growth_interval
            )
        if forward_overflow:  # the host's scale and growth tracker over the back-off torch just made (no read)
            assert self._scale is not None and self._growth_tracker is not None
            self._scale.fill_(scale)
            self._growth_tracker.fill_(tracker)
        bounded = self._bounded(scale)
        if bounded != scale:
            assert self._scale is not None
            self._scale.fill_(bounded)
        self._counters.mirror_scale, self._counters.mirror_tracker = bounded, tracker
        self._counters.last_stepped, self._counters.last_skipped = (
            frozenset(self._iteration.host_found),
            skipped_steps > 0,
        )
        if bounded != scale_before and logger.isEnabledFor(logging.DEBUG):
            logger.debug("loss scale %g -> %g at step %d", scale_before, bounded, self._counters.steps)
        verdict = StepVerdict(
            found, skipped_steps, self._iteration.loss_nonfinite, forward_overflow, scale_before, bounded
        )
        alarms = Alarms()
        self._count(verdict, alarms)
        if alarms.collapse_at is not None or alarms.stall:
            self._raise_alarms(alarms)
        # The listeners this update concerns: all when it overflowed or changed the scale, else those awake.
        quiet, steps = not found and bounded == scale_before, self._counters.steps
        for listener in listeners.overriding["on_update"]:
            if not quiet or steps >= listener.wake_at.get(id(self._handle), 0) or fields.get(listener):
                try:
                    listener.on_update(self._handle, verdict, fields.get(listener, 0))
                except Exception as error:
                    listeners.failed(listener, "update()", error)

    def _resync_mirror(self) -> None:
        """After a failure in ampguard's bookkeeping (torch's update done): the device's truth, bounded."""
        assert self._scale is not None and self._growth_tracker is not None
        self._counters.ledger = None
        self._counters.mirror_scale = float(self._scale.clamp(min=self._min_scale or None, max=self._max_scale).item())
        self._scale.fill_(self._counters.mirror_scale)
        self._counters.mirror_tracker = int(self._growth_tracker.item())

    @property
    def last_step_skipped(self) -> bool:
        """Whether the iteration ended by the last ``update()`` skipped an optimizer step (inf/NaN gradients).

        True for every skip, a forward overflow's included, which keeps the scale:
        ``get_scale() < scale_before`` misses those. Free after a non-fused step;
        after a fused one it reads the device once, as :attr:`stats` does.
        """
        if self._counters.last_skipped is None:
            self._fold_device_ledger()
        return bool(self._counters.last_skipped)

    def knows_skipped(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the host already knows, without a read, that ``optimizer`` (the one stepped in the last
        iteration) skipped its step: what a trainer that asks after every step may ask for free."""
        return self._counters.last_skipped is True and self._counters.last_stepped == {id(optimizer)}

    @property
    def stats(self) -> ScalerStats:
        """A snapshot of the counters (reads the device only after fused-optimizer iterations)."""
        self._fold_device_ledger()
        scale = self._counters.mirror_scale if self._enabled else 1.0
        if scale is None:
            scale = TorchGradScaler.get_scale(self)
        return ScalerStats(
            steps=self._counters.steps,
            skipped=self._counters.skipped,
            no_grad_steps=self._counters.no_grad_steps,
            nonfinite_loss=self._counters.nonfinite_loss,
            scale=float(scale),
            min_scale_seen=self._counters.min_seen,
            max_scale_seen=self._counters.max_seen,
            consecutive_skipped=self._counters.consecutive,
            **listeners.stats_fields(self._handle),
        )

    def _report_now(self) -> None:
        """The stats line every ``AMPGUARD_STATS_EVERY`` steps: due now (``steps`` reached ``next_report``)."""
        every = self._settings.stats_every
        self._counters.next_report = (self._counters.steps // every + 1) * every
        self._report()

    def _report(self) -> None:
        try:
            stats = self.stats
            log_stats(stats, stats.skipped - self._counters.skipped_at_last_report)
            self._counters.skipped_at_last_report = stats.skipped
        except Exception as error:
            containment.report("stats line", error)
