"""What a capability may read of a SafeGradScaler, and nothing it may change: :class:`ScalerView`.

The step listeners (:mod:`ampguard.scaler.listeners`) read a scaler through
its handle's :meth:`~ampguard.scaler.handle.ScalerHandle.view`, the clip patch
through :meth:`SafeGradScaler.view`; both ask for a change through public
methods (``grow_now``, ``skip_step_if``), never the scaler's attributes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ScalerView:
    """A snapshot of the scaler now (no device read): as its last ``update()`` left it, and the iteration since.

    ``scale``: the host's float32 mirror of the scale, None in device mode (a fused optimizer's iteration: the
    scale is on the device only, :attr:`scale_on_device`).
    """

    steps: int  # optimizer steps requested through step()
    scale: float | None
    last_skipped: bool | None  # whether the last update's iteration skipped a step (None: still on the device)
    scale_given: bool  # this iteration's update() was given its new scale (update(new_scale)): it stands
    growth_factor: float
    backoff_factor: float
    max_scale: float
    device: str
    scale_on_device: torch.Tensor | None  # the scale tensor itself (read-only by convention)
    # The iteration in progress: the optimizers unscale_()d since the last scale(), the thread that called scale().
    unscaled: tuple[Any, ...] = ()
    scaling_thread: int | None = None
    scale_read: bool = False  # get_scale() was called after scale() in this iteration
