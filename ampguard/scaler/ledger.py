"""Device mode: the scaler's counters kept on the scale's device, for iterations the host did not see.

Fused optimizers (``Adam(fused=True)`` ...) are stepped by torch without any
host read. For an iteration with such an optimizer (and for ``update(new_scale)``,
``unscale_()`` without ``step()``, and FSDP's ShardedGradScaler) the bookkeeping
moves to a few device tensors (:class:`DeviceLedger`), which are read (one sync)
only when a stats line is due, ``scaler.stats`` is asked for, or a checkpoint is
taken (:func:`fold_device_ledger`); the host mirror is refreshed then and host
mode resumes. Collapses and stalls that happened in device mode are reported at
that read, even if they have ended since.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import torch

from ampguard import healing
from ampguard.log import logger
from ampguard.scaler import policy
from ampguard.syncs import read_to_host

try:
    from torch.amp.grad_scaler import OptState
except ImportError:  # a torch that renamed it: the grad_scaler patch reports itself unavailable
    OptState = None  # type: ignore[assignment, misc]

if TYPE_CHECKING:
    from ampguard.scaler import SafeGradScaler


class DeviceLedger:
    """Counters kept on the scale's device for iterations the host did not see (fused optimizers).

    ``stalls`` (streaks that reached the stall limit), ``max_consecutive`` and
    ``collapsed`` remember stalls and collapses that happened, and perhaps
    ended, between two reads.
    """

    def __init__(self, scale: torch.Tensor, consecutive: int) -> None:
        def zero() -> torch.Tensor:
            return torch.zeros((), dtype=torch.float32, device=scale.device)

        self.skipped = zero()
        self.nonfinite_loss = zero()
        self.consecutive = torch.full((), float(consecutive), dtype=torch.float32, device=scale.device)
        self.max_consecutive = self.consecutive.clone()
        self.stalls = zero()
        self.collapsed = zero()
        self.min_scale = scale.detach().clone()
        self.max_scale = scale.detach().clone()

    def read(self, scale: torch.Tensor, tracker: torch.Tensor) -> list[float]:
        # The one host read of device mode: everything packed into one tensor.
        packed = torch.stack([
            self.skipped, self.nonfinite_loss, self.consecutive, self.max_consecutive, self.stalls, self.collapsed,
            self.min_scale, self.max_scale, scale.float(), tracker.float(),
        ])
        return read_to_host(packed)


def update_in_device_mode(
    scaler: SafeGradScaler, states: dict[int, dict[str, Any]], new_scale: float | torch.Tensor | None
) -> None:
    """``update()`` with the bookkeeping on the device: no host read."""
    assert scaler._scale is not None and scaler._growth_tracker is not None
    if scaler._ledger is None:
        scaler._ledger = DeviceLedger(scaler._scale, scaler._consecutive)
    ledger = scaler._ledger
    scale = scaler._scale
    found_per_optimizer = {
        key: found_flag(scaler, list(s["found_inf_per_device"].values()), scale.device)
        for key, s in states.items()
        if s["found_inf_per_device"]
    }
    if found_per_optimizer:
        stepped = [found for key, found in found_per_optimizer.items() if states[key]["stage"] is OptState.STEPPED]
        if stepped:
            ledger.skipped.add_(stepped[0] if len(stepped) == 1 else torch.stack(stepped).sum())
        flags = list(found_per_optimizer.values())
        found = flags[0] if len(flags) == 1 else torch.stack(flags).amax()
        ledger.consecutive.add_(1.0).mul_(found)
        torch.maximum(ledger.max_consecutive, ledger.consecutive, out=ledger.max_consecutive)
        ledger.stalls.add_(ledger.consecutive == float(scaler._settings.max_consecutive_skips))
        zone = scale * scaler._backoff_factor < 1.0
        if scaler._min_scale > 0:
            zone = zone | (scale <= scaler._min_scale)
        torch.maximum(ledger.collapsed, healing.backward_only(found, scaler._loss_check) * zone, out=ledger.collapsed)
        if scaler._loss_check is not None:
            ledger.nonfinite_loss.add_(scaler._loss_check.isnan().to(scale.device))
    held = healing.hold_scale(scaler, new_scale)  # kept where a loss was non-finite: no back-off
    scaler._torch_update(new_scale)
    healing.keep_scale_on_device(scaler, held)
    if scaler._min_scale > 0 or math.isfinite(scaler._max_scale):
        scale.clamp_(min=scaler._min_scale or None, max=scaler._max_scale)
    torch.minimum(ledger.min_scale, scale, out=ledger.min_scale)
    torch.maximum(ledger.max_scale, scale, out=ledger.max_scale)
    scaler._mirror_scale = None


def found_flag(scaler: SafeGradScaler, found_infs: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One optimizer's found_inf flag (0 or 1) on ``device``: found_inf itself when there is one, already 0/1."""
    if len(found_infs) == 1 and scaler._host_mirror_exact and found_infs[0].device == device:
        return found_infs[0]  # (ShardedGradScaler all-reduces a sum over ranks: that one needs the clamp)
    return torch.stack([t.to(device, non_blocking=True) for t in found_infs]).amax().clamp(max=1.0)


def fold_device_ledger(scaler: SafeGradScaler) -> None:
    """Bring device-mode counters back to the host (one host read)."""
    ledger = scaler._ledger
    if ledger is None or scaler._scale is None or scaler._growth_tracker is None:
        return
    skipped, nonfinite, consecutive, max_consecutive, stalls, collapsed, low, high, scale, tracker = ledger.read(
        scaler._scale, scaler._growth_tracker
    )
    scaler._ledger = None
    scaler._skipped += int(skipped)
    scaler._nonfinite_loss += int(nonfinite)
    scaler._consecutive = int(consecutive)
    scaler._min_seen = min(scaler._min_seen, low)
    scaler._max_seen = max(scaler._max_seen, high)
    scaler._mirror_scale, scaler._mirror_tracker = scale, int(tracker)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("loss scale %g at step %d (range %g..%g since the last report)", scale, scaler._steps, low, high)
    # Collapses and stalls since the last read, even those that ended since.
    if collapsed:
        policy.report_collapse(scaler, low)
    if not policy.in_collapse_zone(scaler, scale):
        scaler._collapse_reported = False
    if stalls:  # a streak reached the limit since the last read: not reported yet
        scaler._stall_reported = False
        policy.check_stall(scaler, int(max_consecutive))
    scaler._stall_reported = scaler._consecutive >= scaler._settings.max_consecutive_skips
