"""How the clip sees the GradScalers: which scaled a loss, which optimizers they unscaled, the scale to divide by."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ampguard.clip_grad.state import ClipOwner, ClipState
from ampguard.log import logger
from ampguard.scaler import SafeGradScaler, live_scalers, params_of

AMBIGUOUS_SCALERS = (
    "clip_grad_norm_: {count} GradScalers scaled a loss in this iteration and some of the gradients being "
    "clipped were not unscaled yet; ampguard cannot tell which scale they carry and clips them as torch would "
    "(call scaler.unscale_(optimizer) before clipping to get the documented behaviour)."
)


FOREIGN_SCALER = (
    "a GradScaler that is not ampguard's ({kind}, created before `import ampguard`?) scaled a loss: "
    "clip_grad_norm_ can no longer tell fp16 steps from bf16/fp32 ones, so its no-scaler NaN guard is off "
    "and it clips as torch does."
)


def scalers_in_play() -> list[SafeGradScaler]:
    """The SafeGradScalers that scaled a loss in this iteration (in this thread when several threads scale)."""
    scalers = [s for s in live_scalers() if getattr(s, "_scale", None) is not None]
    if len(scalers) > 1:  # threads training models of their own: each clips with its own scaler
        here = threading.get_ident()
        scalers = [s for s in scalers if s.view().scaling_thread == here] or scalers
    return scalers


def unscaled_optimizers(scalers: list[SafeGradScaler]) -> list[tuple[SafeGradScaler, Any, set[int]]]:
    """``(scaler, optimizer, ids of its parameters)`` for every optimizer the scalers already unscaled."""
    return [(scaler, optimizer, params_of([optimizer])) for scaler in scalers for optimizer in scaler.view().unscaled]


def single_scale(state: ClipState, scalers: list[SafeGradScaler]) -> Tensor | None:
    """The scale still-scaled gradients carry: None when several scalers are in play (one WARNING)."""
    if len(scalers) == 1:
        return scalers[0].view().scale_on_device
    if not state.warned_ambiguous:
        state.warned_ambiguous = True
        logger.warning(AMBIGUOUS_SCALERS.format(count=len(scalers)))
    return None


def raise_found_inf(
    unscaled_by: list[tuple[SafeGradScaler, Any, set[int]]], clipped: set[int], nan_if_nonfinite: Tensor
) -> None:
    """Optimizers already unscaled have their found_inf recorded; a non-finite norm must skip them too."""
    nonfinite = torch.nan_to_num(nan_if_nonfinite, nan=1.0)  # 1.0 for a non-finite norm, else 0.0
    for scaler, optimizer, ids in unscaled_by:
        if not ids.isdisjoint(clipped):
            scaler.skip_step_if(optimizer, nonfinite)


def scale_wrapper(original: Callable[..., Any], owner: ClipOwner) -> Callable[..., Any]:
    """``GradScaler.scale`` of torch's class, noting a scaler that is not a SafeGradScaler."""

    @functools.wraps(original)
    def scale(self: Any, outputs: Any) -> Any:
        state = owner.clip
        if (
            state is not None
            and not state.foreign_scaler
            and getattr(self, "_enabled", False)
            and not isinstance(self, SafeGradScaler)
        ):
            state.foreign_scaler = True
            if state.guard:
                logger.warning(FOREIGN_SCALER.format(kind=f"{type(self).__module__}.{type(self).__qualname__}"))
        return original(self, outputs)

    # What a SafeGradScaler calls instead (it is never foreign), with the wrapper itself: functools.wraps copies
    # the attribute onto another library's wrapper of this one, which must still run.
    scale.unwatched = (scale, original)  # type: ignore[attr-defined]
    return scale
