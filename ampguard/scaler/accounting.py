"""Host mode: the scaler's counters and its float32 mirror of the scale, riding on torch's one read.

torch's ``step()`` reads the optimizer's found_inf flag on the host once
(``_maybe_opt_step``); that read also carries "was the loss non-finite?" and the
fields of the capabilities listening to the scaler (:func:`step_code`,
:func:`note_verdict`; :mod:`ampguard.scaler.listeners`). From there ``update()`` keeps its
bookkeeping on the host (:func:`update_in_host_mode`): skip counts, the mirror
of the scale (torch's rule replayed, :func:`ampguard.scaler.policy.next_scale`),
the floor, the cap, collapse and stall detection. The counters are what
``scaler.stats`` shows (:func:`snapshot`) and what the periodic stats line
reports (:func:`report_if_due`).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch

import ampguard.containment as containment
import ampguard.distributed as distributed
import ampguard.scaler.diagnose as diagnose
import ampguard.scaler.ledger as ledger
import ampguard.scaler.listeners as listeners
import ampguard.scaler.policy as policy
from ampguard.log import logger
from ampguard.scaler.live import TorchGradScaler
from ampguard.stats.counters import ScalerStats, log_stats

try:
    from torch.amp.grad_scaler import _refresh_per_optimizer_state
except ImportError:  # a torch that renamed it: the grad_scaler patch reports itself unavailable
    _refresh_per_optimizer_state = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from ampguard.scaler.safe import SafeGradScaler


def step_code(scaler: SafeGradScaler, optimizer_state: dict[str, Any]) -> tuple[torch.Tensor, listeners.Layout]:
    """found_inf (0/1), + 2 when a loss was non-finite, + the listeners' fields: one value for torch's one read."""
    found_infs = list(optimizer_state["found_inf_per_device"].values())
    total = found_infs[0]
    for other in found_infs[1:]:
        total = total + other.to(total.device, non_blocking=True)
    code = total.clamp(max=1.0) if len(found_infs) > 1 or not scaler._host_mirror_exact else total  # 0 or 1
    if scaler._iteration.loss_check is not None:
        # + 2 when a loss was non-finite (its check is NaN): still one value, one read.
        code = code + torch.nan_to_num(scaler._iteration.loss_check.to(code.device, non_blocking=True), nan=2.0)
    return listeners.encode(scaler, code)


def note_verdict(
    scaler: SafeGradScaler, optimizer: torch.optim.Optimizer, value: int, layout: listeners.Layout
) -> bool:
    """Everything the host learns from the one read; returns whether the step is skipped."""
    found = bool(value & listeners.FOUND)
    scaler._iteration.host_found[id(optimizer)] = found
    fields = listeners.decode(layout, value)
    for listener, field in fields.items():  # the largest of the iteration's reads
        scaler._iteration.fields[listener] = max(field, scaler._iteration.fields.get(listener, 0))
    listeners.notify_read(scaler, optimizer, fields, found)
    if value & listeners.LOSS_NONFINITE:
        scaler._iteration.loss_nonfinite = True
    if found:
        diagnose.on_skipped_step(scaler, optimizer, loss_nonfinite=bool(value & 2), step=scaler._counters.steps + 1)
    return found


def update(scaler: SafeGradScaler, new_scale: float | torch.Tensor | None) -> None:
    """``update()`` of an enabled scaler: host mode, device mode, or torch's own when ampguard's bookkeeping fails."""
    states = scaler._per_optimizer_states
    scaler._torch_updated = False
    scaler._iteration.scale_given = new_scale is not None
    try:
        if new_scale is None and not any(s["found_inf_per_device"] for s in states.values()):
            scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)  # no inf checks: scale kept
            scaler._counters.last_stepped, scaler._counters.last_skipped = frozenset(), False
        elif new_scale is None and host_saw_everything(scaler, states):
            update_in_host_mode(scaler)
        else:
            ledger.update_in_device_mode(scaler, states, new_scale)
    except Exception as error:
        passing = containment.passes_through(error)
        if passing is not None:
            raise passing from None
        containment.report("scale bookkeeping (update())", error)
        if not scaler._torch_updated:  # torch's update if it did not run, then the device's truth
            TorchGradScaler.update(scaler, new_scale)
        resync_mirror(scaler)


def host_saw_everything(scaler: SafeGradScaler, states: dict[int, dict[str, Any]]) -> bool:
    """Every optimizer with a found_inf was read on the host this iteration (no fused one, no ledger pending)."""
    return (
        scaler._counters.ledger is None
        and scaler._host_mirror_exact
        and all(key in scaler._iteration.host_found for key, s in states.items() if s["found_inf_per_device"])
    )


def update_in_host_mode(scaler: SafeGradScaler) -> None:
    found = any(scaler._iteration.host_found.values())
    forward_overflow, fields = False, scaler._iteration.fields
    if found:  # was a loss itself inf/NaN, on any rank? (an exchange under torch.distributed, else free)
        loss_nonfinite, agreed = distributed.agree_on_skip(scaler._iteration.loss_nonfinite, list(fields.values()))
        forward_overflow = policy.forward_overflow(found, loss_nonfinite)
        fields = dict(zip(fields, agreed))
    skipped_steps = sum(scaler._iteration.host_found.values())
    scale_before = scaler._counters.mirror_scale
    assert scale_before is not None
    scaler._torch_update()
    # A forward overflow (the loss itself inf/NaN) was not the scale's doing, and its step taught nothing about
    # the gradients: the scale and the growth tracker stay as they were, written over torch's back-off.
    scale, tracker = policy.counted(
        scale_before,
        scaler._counters.mirror_tracker,
        found,
        forward_overflow,
        scaler._growth_factor,
        scaler._backoff_factor,
        scaler._growth_interval,
    )
    if forward_overflow:  # the host's scale and growth tracker over the back-off torch just made (no read)
        assert scaler._scale is not None and scaler._growth_tracker is not None
        scaler._scale.fill_(scale)
        scaler._growth_tracker.fill_(tracker)
    bounded = policy.bounded(scaler, scale)
    if bounded != scale:
        assert scaler._scale is not None
        scaler._scale.fill_(bounded)
    scaler._counters.mirror_scale, scaler._counters.mirror_tracker = bounded, tracker
    scaler._counters.min_seen = min(scaler._counters.min_seen, bounded)
    scaler._counters.max_seen = max(scaler._counters.max_seen, bounded)
    scaler._counters.skipped += skipped_steps
    scaler._counters.last_stepped, scaler._counters.last_skipped = (
        frozenset(scaler._iteration.host_found),
        skipped_steps > 0,
    )
    if scaler._iteration.loss_nonfinite:
        scaler._counters.nonfinite_loss += 1
    if bounded != scale_before and logger.isEnabledFor(logging.DEBUG):
        logger.debug("loss scale %g -> %g at step %d", scale_before, bounded, scaler._counters.steps)
    if found:
        scaler._counters.consecutive += 1
        if not forward_overflow and policy.in_collapse_zone(scaler, scale_before):
            policy.report_collapse(scaler, scale_before)
        policy.check_stall(scaler, scaler._counters.consecutive)
    else:
        scaler._counters.consecutive = 0
        scaler._counters.stall_reported = False
    if not policy.in_collapse_zone(scaler, bounded):
        scaler._counters.collapse_reported = False
    listeners.notify_update(scaler, forward_overflow, fields)


def resync_mirror(scaler: SafeGradScaler) -> None:
    """After a failure in ampguard's bookkeeping (torch's update done): the device's truth, bounded."""
    assert scaler._scale is not None and scaler._growth_tracker is not None
    scaler._counters.ledger = None
    scaler._counters.mirror_scale = float(
        scaler._scale.clamp(min=scaler._min_scale or None, max=scaler._max_scale).item()
    )
    scaler._scale.fill_(scaler._counters.mirror_scale)
    scaler._counters.mirror_tracker = int(scaler._growth_tracker.item())


def last_step_skipped(scaler: SafeGradScaler) -> bool:
    """``scaler.last_step_skipped``: reads the device only when the verdict is still there (device mode)."""
    if scaler._counters.last_skipped is None:
        ledger.fold_device_ledger(scaler)
    return bool(scaler._counters.last_skipped)


def known_skip(scaler: SafeGradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """Whether the host already knows that ``optimizer``, the one stepped in the last iteration, skipped (no read)."""
    return scaler._counters.last_skipped is True and scaler._counters.last_stepped == {id(optimizer)}


def snapshot(scaler: SafeGradScaler) -> ScalerStats:
    """``scaler.stats``: the counters (reads the device only after device-mode iterations)."""
    ledger.fold_device_ledger(scaler)
    scale = scaler._counters.mirror_scale if scaler._enabled else 1.0
    if scale is None:
        scale = TorchGradScaler.get_scale(scaler)
    return ScalerStats(
        steps=scaler._counters.steps,
        skipped=scaler._counters.skipped,
        no_grad_steps=scaler._counters.no_grad_steps,
        nonfinite_loss=scaler._counters.nonfinite_loss,
        scale=float(scale),
        min_scale_seen=scaler._counters.min_seen,
        max_scale_seen=scaler._counters.max_seen,
        consecutive_skipped=scaler._counters.consecutive,
        **listeners.stats_fields(scaler),
    )


def report_if_due(scaler: SafeGradScaler) -> None:
    """The stats line every ``AMPGUARD_STATS_EVERY`` steps."""
    if scaler._counters.next_report and scaler._counters.steps >= scaler._counters.next_report:
        every = scaler._settings.stats_every
        scaler._counters.next_report = (scaler._counters.steps // every + 1) * every
        _report(scaler)


def _report(scaler: SafeGradScaler) -> None:
    try:
        stats = scaler.stats
        log_stats(stats, stats.skipped - scaler._counters.skipped_at_last_report)
        scaler._counters.skipped_at_last_report = stats.skipped
    except Exception as error:
        containment.report("stats line", error)
