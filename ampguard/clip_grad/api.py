"""The rest of torch's clipping API under ampguard: what :mod:`ampguard.clip_grad.norm` does for ``clip_grad_norm_``.

``torch.nn.utils.clip_grad_value_``, and (torch >= 2.6) ``get_total_norm`` and
``clip_grads_with_norm_``, the two halves ``clip_grad_norm_`` is made of,
act on the unscaled gradients while a :class:`~ampguard.SafeGradScaler` is in
play, with the same rules and no host read (docs/clipping.md):

* **Which gradients are still scaled.** As for ``clip_grad_norm_``: every
  gradient except those of the parameters of an optimizer a scaler in play
  already unscaled. With master weights the gradient of such a parameter lives
  in its float32 master from ``unscale_`` on; that tensor is the one clipped.
* ``clip_grad_value_(params, clip_value)`` clamps still-scaled gradients at
  ``clip_value * scale`` (a device tensor, no host read) and the others at
  ``clip_value``: after ``unscale_`` the gradients are torch's clamp of the
  unscaled ones, bit for bit (the scale is a power of two). With every
  gradient still scaled and ``get_scale()`` read after ``scale()`` (the idiom
  ``clip_grad_value_(params, clip_value * scaler.get_scale())``) the bound is
  taken as given, a bound for scaled gradients, as ``clip_grad_norm_`` reads
  its threshold. A still-scaled gradient holding inf/NaN becomes NaN instead
  of the bound, so that ``unscale_`` finds the overflow and the step is
  skipped, as in the recipe.
* ``get_total_norm(tensors)`` receives gradient *tensors*, not parameters.
  A tensor is taken as unscaled when it is the ``.grad`` (or the master's
  ``.grad``) of a parameter of an optimizer a scaler already unscaled (matched
  by identity; ``p.grad`` of a half-precision parameter with a master is
  replaced by the master's gradient, which holds the unscaled value); every
  other tensor is taken as a still-scaled gradient and measured unscaled (as
  ``clip_grad_norm_`` measures it). The returned norm is the unscaled one, float32 for float16/bfloat16
  tensors (also when no scaler is in play and the no-scaler guard is on);
  torch's scaled norm when every tensor is still scaled and ``get_scale()`` was
  read after ``scale()`` (the scaled-threshold idiom, as ``clip_grad_norm_`` reads it).
* ``clip_grads_with_norm_(params, max_norm, total_norm)`` takes ``total_norm``
  as the unscaled norm (what ``get_total_norm`` returns): the coefficient is
  torch's, and multiplying still-scaled gradients by it gives, after
  ``unscale_``, torch's result on unscaled ones. A non-finite ``total_norm``
  makes the coefficient NaN, so every optimizer whose gradients were clipped
  skips its step, as with ``clip_grad_norm_``.

Tensor subclasses (DTensor under FSDP2), no gradient at all, and calls with no
SafeGradScaler in play go to torch's function unchanged (``get_total_norm``
still takes float32 norms while the no-scaler guard is on).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

import ampguard.clip_grad.kernels as kernels
import ampguard.scaler.listeners as listeners
from ampguard.clip_grad.norm import idle as clip_grad_norm_idle
from ampguard.clip_grad.norm import scaled_threshold, scaled_total_norm
from ampguard.clip_grad.scalers import raise_found_inf, scalers_in_play, single_scale, unscaled_optimizers
from ampguard.clip_grad.state import ClipState
from ampguard.clip_grad.wrapping import contained
from ampguard.scaler import SafeGradScaler, scalers_in_iteration


def idle(state: ClipState) -> bool:
    """No SafeGradScaler scaled a loss in this iteration: torch's function, untouched."""
    return not scalers_in_iteration


def _plain(tensors: Iterable[Tensor]) -> bool:
    return all(type(t) in kernels.PLAIN_TENSOR_TYPES for t in tensors)


# -- clip_grad_value_ -----------------------------------------------------------------


def _bind_value(parameters: Any, clip_value: float, foreach: bool | None = None) -> tuple[Any, float, bool | None]:
    return parameters, clip_value, foreach


@contained("safe clip_grad_value_")
def clip_grad_value_wrapper(
    state: ClipState, wrapped: Callable[..., None], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """wrapt wrapper of ``torch.nn.utils.clip_grad_value_``."""
    if instance is not None or idle(state):
        return wrapped(*args, **kwargs)
    try:
        parameters, clip_value, foreach = _bind_value(*args, **kwargs)
    except TypeError:  # torch's own error
        return wrapped(*args, **kwargs)
    params, for_torch = kernels.materialize(parameters)
    pairs = listeners.gradient_pairs(params)
    scalers = scalers_in_play()
    if not pairs or not scalers or not _plain(g for _, g in pairs):
        return wrapped(for_torch, clip_value, foreach)
    clip_value = float(clip_value)
    unscaled = set().union(*(ids for _, _, ids in unscaled_optimizers(scalers)))
    still_scaled = {id(g) for p, g in pairs if id(p) not in unscaled}
    scale = single_scale(state, scalers) if still_scaled else None
    if scale is None:
        still_scaled = set()
    elif len(still_scaled) == len(pairs) and scaled_threshold(scalers[0]):
        # get_scale() read after scale(): clip_grad_value_(params, clip_value * scaler.get_scale()) on still-scaled
        # gradients, the idiom clip_grad_norm_ reads alike (norm.scaled_threshold): the bound as given, torch's.
        scale = torch.ones((), dtype=torch.float32)
    with torch.no_grad():
        for group in kernels.groups([g for _, g in pairs], foreach):
            _clamp_(group, [g for g in group.grads if id(g) not in still_scaled], clip_value)
            scaled = [g for g in group.grads if id(g) in still_scaled]
            if scaled:
                assert scale is not None
                overflowed = _nan_if_nonfinite(group, scaled)
                # In the gradients' dtype, as torch compares: scale * round(clip_value) = round(scale * clip_value).
                _clamp_(group, scaled, (scale.to(group.device) * clip_value).to(group.dtype))
                _multiply_(group, scaled, overflowed)
    return None


def _nan_if_nonfinite(group: kernels.Group, grads: list[Tensor]) -> list[Tensor]:
    """Per gradient: 1, or NaN where it holds inf/NaN (its inf-norm minus itself, plus 1). No host read.

    The clamp would turn a still-scaled inf into the finite bound, and the
    scaler's later ``unscale_`` would never see the overflow: multiplied in
    after the clamp, the NaN makes that gradient's optimizer skip its step, as
    in the recipe, where ``unscale_`` found the inf before the clamp. (A
    multiplication by 1, not an addition of 0: -0.0 stays -0.0, as torch's clamp left it.)
    """
    peaks = kernels.norms(group, grads, math.inf)
    if group.foreach:
        flags = torch._foreach_sub(peaks, peaks)
        torch._foreach_add_(flags, 1.0)
        return list(flags)
    return [peak - peak + 1.0 for peak in peaks]


def _multiply_(group: kernels.Group, grads: list[Tensor], flags: list[Tensor]) -> None:
    if group.foreach:
        torch._foreach_mul_(grads, flags)
        return
    for grad, flag in zip(grads, flags):
        grad.mul_(flag)


def _clamp_(group: kernels.Group, grads: list[Tensor], bound: float | Tensor) -> None:
    """torch's clamp of ``grads`` into [-bound, bound], foreach or per tensor as ``group`` says."""
    if not grads:
        return
    if group.foreach:
        if isinstance(bound, Tensor):
            torch._foreach_clamp_min_(grads, [-bound] * len(grads))
            torch._foreach_clamp_max_(grads, [bound] * len(grads))
        else:
            torch._foreach_clamp_min_(grads, -bound)
            torch._foreach_clamp_max_(grads, bound)
        return
    for g in grads:
        g.clamp_(min=-bound, max=bound)  # type: ignore[arg-type]  # a float or a tensor: both accepted


# -- get_total_norm -------------------------------------------------------------------


def _bind_total(
    tensors: Any, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: bool | None = None
) -> tuple[Any, float, bool, bool | None]:
    return tensors, norm_type, error_if_nonfinite, foreach


@contained("safe get_total_norm")
def get_total_norm_wrapper(
    state: ClipState, wrapped: Callable[..., Tensor], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Tensor:
    """wrapt wrapper of ``torch.nn.utils.get_total_norm`` (torch >= 2.6)."""
    if instance is not None or clip_grad_norm_idle(state):
        return wrapped(*args, **kwargs)
    try:
        tensors, norm_type, error_if_nonfinite, foreach = _bind_total(*args, **kwargs)
    except TypeError:
        return wrapped(*args, **kwargs)
    given, for_torch = kernels.materialize(tensors)
    scalers = scalers_in_play()
    if not given or not _plain(given) or not (scalers or state.guard_active()):
        return wrapped(for_torch, norm_type, error_if_nonfinite, foreach)
    norm_type = float(norm_type)
    with torch.no_grad():
        held = _gradients_held(given, scalers)
        scale = single_scale(state, scalers) if held.still_scaled is None or held.still_scaled else None
        every_one_scaled = held.still_scaled is None or all(id(g) in held.still_scaled for g in held.grads)
        if every_one_scaled and scale is not None and scaled_threshold(scalers[0]):
            # get_scale() read after scale(): the norm for clip_grads_with_norm_(params, max_norm * scale, norm) on
            # still-scaled gradients, torch's idiom, as clip_grad_norm_ reads it (norm.scaled_threshold): torch's.
            scale = None
        groups = kernels.groups(held.grads, foreach)
        total = scaled_total_norm(groups, held.still_scaled, scale, norm_type)
        if error_if_nonfinite:
            kernels.raise_if_nonfinite(total, norm_type)
    return total


class _Held(NamedTuple):
    grads: list[Tensor]  # the tensors holding the gradients passed (a master's in place of p.grad)
    still_scaled: set[int] | None  # ids of those still scaled; None: all of them


def _gradients_held(tensors: Sequence[Tensor], scalers: list[SafeGradScaler]) -> _Held:
    """Map the tensors passed to get_total_norm back to the optimizers the scalers unscaled (by identity)."""
    if not scalers:
        return _Held(list(tensors), set())
    holder: dict[int, Tensor] = {}
    for _, optimizer, _ in unscaled_optimizers(scalers):
        for param, grad in listeners.gradients(optimizer):
            if grad is None:
                continue
            holder[id(grad)] = grad
            if param.grad is not None:
                holder[id(param.grad)] = grad  # p.grad of a parameter whose master holds the gradient
    if not holder:
        return _Held(list(tensors), None)
    return _Held([holder.get(id(t), t) for t in tensors], {id(t) for t in tensors if id(t) not in holder})


# -- clip_grads_with_norm_ ------------------------------------------------------------


def _bind_with_norm(
    parameters: Any, max_norm: float, total_norm: Tensor, foreach: bool | None = None
) -> tuple[Any, float, Tensor, bool | None]:
    return parameters, max_norm, total_norm, foreach


@contained("safe clip_grads_with_norm_")
def clip_grads_with_norm_wrapper(
    state: ClipState, wrapped: Callable[..., None], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """wrapt wrapper of ``torch.nn.utils.clip_grads_with_norm_`` (torch >= 2.6)."""
    if instance is not None or idle(state):
        return wrapped(*args, **kwargs)
    try:
        parameters, max_norm, total_norm, foreach = _bind_with_norm(*args, **kwargs)
    except TypeError:
        return wrapped(*args, **kwargs)
    params, for_torch = kernels.materialize(parameters)
    pairs = listeners.gradient_pairs(params)
    scalers = scalers_in_play()
    if not pairs or not scalers or not isinstance(total_norm, Tensor) or not _plain(g for _, g in pairs):
        return wrapped(for_torch, max_norm, total_norm, foreach)
    with torch.no_grad():
        groups = kernels.groups([g for _, g in pairs], foreach)
        nan_if_nonfinite = total_norm - total_norm  # see norm._clip_with_scaler
        coefficient = kernels.clip_coefficient(float(max_norm), total_norm) + nan_if_nonfinite
        kernels.multiply_(groups, coefficient)
        unscaled_by = unscaled_optimizers(scalers)
        if unscaled_by:
            raise_found_inf(unscaled_by, {id(p) for p, _ in pairs}, nan_if_nonfinite)
    return None


# (name in torch.nn.utils.clip_grad, wrapper, idle): the clip_grad patch wraps those this torch has.
WRAPPED: list[tuple[str, Callable[..., Any], Callable[[ClipState], bool]]] = [
    ("clip_grad_value_", clip_grad_value_wrapper, idle),
    ("_get_total_norm", get_total_norm_wrapper, clip_grad_norm_idle),  # torch.nn.utils.get_total_norm
    ("_clip_grads_with_norm_", clip_grads_with_norm_wrapper, idle),  # torch.nn.utils.clip_grads_with_norm_
]
