"""``clip_grad_norm_`` under ampguard: the safe clip and the wrappers torch's names are bound to.

The documented AMP recipe is scale -> backward -> unscale_ -> clip -> step.
Under ampguard the clip is right whatever the caller did:

* **Still-scaled gradients** (``unscale_`` forgotten, Lightning manual
  optimisation, a library that clips before stepping): when a
  :class:`~ampguard.SafeGradScaler` scaled a loss this iteration and the
  parameters are not owned by an optimizer it already unscaled, the norm is
  that of the unscaled gradients: float32 gradients under a power-of-two scale
  are unscaled in place for it and scaled back (both exact: the recipe's bits);
  for other float32 ones (another scale, a scale only the device knows) the
  norms are taken of temporary copies times the inverse ``unscale_`` uses (the
  recipe's norm; never an overflow of the scaled one); the float32 per-tensor
  norms of float16/bfloat16 gradients are divided by the scale. The
  clip coefficient is multiplied into the still-scaled gradients, and the
  scaler's later ``unscale_`` divides them by the scale: the optimizer sees what
  the recipe gives, the returned norm is the unscaled one, and nothing is ever
  unscaled twice. Parameters already unscaled (accelerate, HF Trainer,
  Lightning automatic optimisation, the coqui trainer) are clipped as they are;
  a call may mix both kinds.
* **A threshold for scaled gradients.** The idiom from before ``unscale_``
  existed, ``clip_grad_norm_(params, max_norm * scaler.get_scale())`` on
  still-scaled gradients, gives torch's result (gradients and returned norm):
  when the caller read ``get_scale()`` after ``scale()`` in this iteration,
  ``max_norm`` is taken as a threshold for the scaled gradients. The one
  ambiguity: code that reads ``get_scale()`` that way for another reason
  (logging) and then clips still-scaled gradients with an unscaled threshold
  gets torch's behaviour too (docs/clipping.md).
* **Norms in float32** for float16 and bfloat16 gradients: torch computes them
  in the gradients' dtype, so a float16 norm above 65504 becomes inf, the
  coefficient 0 and every gradient a finite zero that no scaler notices.
* **Non-finite norms.** With a scaler in play the coefficient becomes NaN, so
  every optimizer whose gradients were clipped skips its step (the scaler
  records inf for still-scaled gradients at ``unscale_``; for optimizers it
  already unscaled, the found-inf flag is raised on the device). No host read.
  With no GradScaler in play (bf16 / fp32 training) the norm is read on the
  host once; when it is inf/NaN the step is skipped by setting the clipped
  parameters' ``.grad`` to None, so the optimizer changes no parameter and no
  state. ``error_if_nonfinite=True`` raises as torch does.

In the recipe's case (every clipped gradient unscaled by the one optimizer
holding it) float32 gradients are clipped by torch's own functions.
Elsewhere the computation is torch's (same operations, the gradients grouped by device
and dtype once instead of twice) except for the float32 norms, the division by
the scale and the NaN coefficient: with float32 gradients, no scaler and finite
norms the result is bit-identical to torch's. docs/clipping.md has the details
and the measured cost.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import wrapt
from torch import Tensor

import ampguard.clip_grad.kernels as kernels
import ampguard.clip_grad.no_scaler as no_scaler
import ampguard.containment as containment
import ampguard.scaler.listeners as listeners
from ampguard.clip_grad.scalers import raise_found_inf, scalers_in_play, single_scale, unscaled_optimizers
from ampguard.clip_grad.state import ClipState
from ampguard.clip_grad.wrapping import caller_stacklevel, contained
from ampguard.scaler import SafeGradScaler, scalers_in_iteration
from ampguard.scaler.counters import counters_of


def idle(state: ClipState) -> bool:
    """Nothing for the safe clip to do: no SafeGradScaler scaled a loss and the no-scaler guard is off.

    O(1): then ``clip_grad_norm_`` is torch's function, untouched (its wrapper's first question, every call).
    """
    return not scalers_in_iteration and not (state.guard and not state.foreign_scaler)


@contained("safe clip_grad_norm_")
def clip_grad_norm_wrapper(
    state: ClipState, wrapped: Callable[..., Tensor], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Tensor:
    """Wrapper of ``torch.nn.utils.clip_grad_norm_`` (its :class:`SafeFunctionWrapper` asked :func:`idle`)."""
    if instance is not None:
        return wrapped(*args, **kwargs)
    try:
        parameters, max_norm, norm_type, error_if_nonfinite, foreach = _bind(*args, **kwargs)
    except TypeError:  # torch raises its own error, or knows an argument this torch added
        return wrapped(*args, **kwargs)
    case = _recipe_case(parameters) if isinstance(parameters, (list, tuple)) else None
    if case is None:
        return safe_clip_grad_norm_(state, wrapped, parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    grads, low_precision = case
    if low_precision:
        return _clip_unscaled(grads, max_norm, norm_type, error_if_nonfinite, foreach)
    halves = state.halves
    if halves is None:  # torch < 2.6: one function
        return wrapped(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    # torch's clip_grad_norm_ is these two; called unwrapped, as their wrappers would ask again what is scaled.
    try:  # (containment.torch_call inlined, every clip: torch's errors are torch's, raised once)
        total = halves[0](grads, norm_type, error_if_nonfinite, foreach)
        halves[1](parameters, max_norm, total, foreach)
    except Exception as error:
        raise containment.FromTorch(error) from None
    return total


def deprecated_clip_grad_norm_wrapper(
    state: ClipState, wrapped: Callable[..., Tensor], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Tensor:
    """wrapt wrapper of the deprecated ``torch.nn.utils.clip_grad_norm``.

    torch's function warns, then calls ``clip_grad_norm_``. Calling it from
    here would attribute its warning to this file, so the wrapper issues
    torch's warning (as recorded by :func:`record_deprecation`) at the caller
    and calls the safe ``clip_grad_norm_`` itself.
    """
    deprecation = state.deprecation
    if instance is not None or deprecation is None:
        return wrapped(*args, **kwargs)
    try:
        _bind(*args, **kwargs)
    except TypeError:
        return wrapped(*args, **kwargs)  # torch's own error, from torch's own function
    warnings.warn(deprecation[1], deprecation[0], stacklevel=caller_stacklevel())
    safe = torch.nn.utils.clip_grad.clip_grad_norm_
    if not isinstance(safe, wrapt.FunctionWrapper):  # somebody replaced it since
        return clip_grad_norm_wrapper(state, state.original, None, args, kwargs)
    result: Tensor = safe(*args, **kwargs)
    return result


def _bind(
    parameters: Tensor | Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> tuple[Tensor | Iterable[Tensor], float, float, bool, bool | None]:
    return parameters, max_norm, norm_type, error_if_nonfinite, foreach


def _recipe_case(params: Sequence[Tensor]) -> tuple[list[Tensor], bool] | None:
    """The recipe's case, where the clip is torch's: the gradients to clip, and whether some are float16/bfloat16
    (their norms are then taken in float32, else torch's own clip runs); None: another case.

    One SafeGradScaler scaled a loss in this iteration and already unscaled the
    one optimizer holding every parameter clipped: nothing is still scaled, and
    a non-finite norm means a non-finite gradient that optimizer's ``unscale_``
    already found (it skips its step whatever the clip does). A parameter with
    a master weight is clipped through its master's float32 gradient.
    """
    if len(scalers_in_iteration) != 1:
        return None
    grads: list[Tensor] = []
    clipped: set[int] = set()
    low_precision = False
    for param in params:  # (a loop: no generator frame per parameter at every clip)
        grad = param.grad
        if grad is None:
            continue
        if type(grad) not in kernels.PLAIN_TENSOR_TYPES:
            return None
        low_precision = low_precision or grad.dtype in kernels.LOW_PRECISION
        grads.append(grad)
        clipped.add(id(param))
    if low_precision:
        held = listeners.gradient_holders  # (listeners.gradient_pairs, inline: every clip)
        pairs = held.of_parameters(params) if held is not None else [(p, p.grad) for p in params if p.grad is not None]
        grads = [grad for _, grad in pairs]
        clipped = {id(param) for param, _ in pairs}
    scaler = next(iter(scalers_in_iteration), None)
    if not grads or scaler is None:
        return None
    holders = [ids for ids in map(_param_ids, scaler.view().unscaled) if not ids.isdisjoint(clipped)]
    return (grads, low_precision) if len(holders) == 1 and clipped <= holders[0] else None


def _param_ids(optimizer: Any) -> set[int]:
    return set(map(id, itertools.chain.from_iterable(map(operator.itemgetter("params"), optimizer.param_groups))))


def _clip_unscaled(
    grads: list[Tensor], max_norm: float, norm_type: float, error_if_nonfinite: bool, foreach: bool | None
) -> Tensor:
    """torch's clip of gradients nothing scales any more, with float32 norms for float16/bfloat16 ones."""
    norm_type = float(norm_type)  # (as torch: its messages say "order 2.0")
    with torch.no_grad():
        groups = kernels.groups(grads, foreach)
        total = kernels.total_norm(groups, norm_type)
        if error_if_nonfinite:
            kernels.raise_if_nonfinite(total, norm_type)
        kernels.multiply_(groups, kernels.clip_coefficient(float(max_norm), total))
    return total


def safe_clip_grad_norm_(
    state: ClipState,
    torch_clip: Callable[..., Tensor],
    parameters: Tensor | Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` made safe (see the module docstring).

    Arguments after ``torch_clip`` and the return value are torch's; the
    returned norm is that of the unscaled gradients, in float32 when they are
    float16/bfloat16. ``torch_clip`` is torch's function, used where ampguard
    has nothing to add (no gradient at all, tensor subclasses such as DTensor,
    a GradScaler ampguard does not know).
    """
    params, for_torch = kernels.materialize(parameters)
    pairs = listeners.gradient_pairs(params)  # a master's float32 gradient once unscale_ put it there
    if not pairs or not kernels.plain_gradients(pairs):
        return containment.torch_call(torch_clip, for_torch, max_norm, norm_type, error_if_nonfinite, foreach)
    scalers = scalers_in_play()
    if not scalers and not state.guard_active():
        return containment.torch_call(torch_clip, for_torch, max_norm, norm_type, error_if_nonfinite, foreach)
    max_norm = float(max_norm)
    norm_type = float(norm_type)
    with torch.no_grad():
        if scalers:
            return _clip_with_scaler(state, pairs, scalers, max_norm, norm_type, error_if_nonfinite, foreach)
        return no_scaler.clip(state, pairs, max_norm, norm_type, error_if_nonfinite, foreach)


def _clip_with_scaler(
    state: ClipState,
    pairs: list[tuple[Tensor, Tensor]],
    scalers: list[SafeGradScaler],
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    foreach: bool | None,
) -> Tensor:
    """A SafeGradScaler scaled a loss this iteration: zero host reads (beyond torch's own)."""
    unscaled_by = unscaled_optimizers(scalers)
    unscaled_params: set[int] = set().union(*(ids for _, _, ids in unscaled_by))
    grads = [g for _, g in pairs]
    # None: every gradient of this call is still scaled (unscale_ forgotten, or another optimizer's were unscaled).
    still_scaled = {id(g) for p, g in pairs if id(p) not in unscaled_params} if unscaled_params else None
    if still_scaled is not None and len(still_scaled) == len(grads):
        still_scaled = None
    scale = single_scale(state, scalers) if still_scaled is None or still_scaled else None
    groups = kernels.groups(grads, foreach)
    scale_known = scale is not None and norm_type != 0.0  # the "0-norm" counts non-zeros: scale-free
    threshold_is_scaled = scale_known and scaled_threshold(scalers[0])
    if threshold_is_scaled and still_scaled is None:
        # clip_grad_norm_(params, max_norm * scaler.get_scale()) on still-scaled gradients: torch's own numbers.
        total = kernels.total_norm(groups, norm_type)
        if error_if_nonfinite:
            kernels.raise_if_nonfinite(total, norm_type)
        kernels.multiply_(groups, kernels.clip_coefficient(max_norm, total) + (total - total))
        return total
    threshold: float | Tensor = max_norm
    if threshold_is_scaled:
        assert scale is not None
        threshold = max_norm / scale.to(grads[0].device)
    round_trip = _round_trip(groups, still_scaled, scalers[0]) if scale_known else []
    if round_trip:
        assert scale is not None
        # The recipe's numbers for float32 gradients under a power-of-two scale: unscaled in place by the
        # inverse unscale_ uses, clipped, and scaled back. Both multiplications by the scale are exact, so the
        # total is the recipe's and unscale_ later leaves the recipe's gradients, bit for bit.
        kernels.multiply_(round_trip, scale.double().reciprocal().float())
        in_place = {id(g) for group in round_trip for g in group.grads}
        still_scaled = {
            id(g) for g in grads if id(g) not in in_place and (still_scaled is None or id(g) in still_scaled)
        }
    try:
        total = scaled_total_norm(groups, still_scaled, scale, norm_type)
        if error_if_nonfinite:
            kernels.raise_if_nonfinite(total, norm_type)
        clipped = {id(p) for p, _ in pairs}
        if _checked_by_one_optimizer(unscaled_by, clipped):
            # The recipe's case: every clipped gradient was checked by one optimizer's unscale_, so a
            # non-finite norm means a non-finite gradient that optimizer already skips for: torch's kernels.
            kernels.multiply_(groups, kernels.clip_coefficient(threshold, total))
            return total
        # total - total is 0 for a finite norm and NaN for an inf/NaN one (2 kernels here, against 5 for
        # isfinite + div): added to the coefficient it leaves it unchanged or makes it NaN, and every
        # clipped step is skipped.
        nan_if_nonfinite = total - total
        kernels.multiply_(groups, kernels.clip_coefficient(threshold, total) + nan_if_nonfinite)
    except BaseException:
        if round_trip:  # as torch leaves them when it raises, or for the fallback to torch's own clip
            assert scale is not None
            kernels.multiply_(round_trip, scale)
        raise
    if round_trip:
        assert scale is not None
        kernels.multiply_(round_trip, scale)
    if unscaled_by:
        raise_found_inf(unscaled_by, clipped, nan_if_nonfinite)
    return total


def _round_trip(
    groups: list[kernels.Group], still_scaled: set[int] | None, scaler: SafeGradScaler
) -> list[kernels.Group]:
    """The still-scaled gradients that are unscaled in place for the norm: float32/float64 ones, each once,
    when the scale is a power of two (so that scaling back is exact). Float16/bfloat16 gradients would lose
    their small values to subnormals: their norms are divided by the scale instead."""
    counters = counters_of(scaler)
    mirror = counters.mirror_scale if counters is not None else None
    if mirror is None or math.frexp(mirror)[0] != 0.5:  # not known on the host (device mode), or not 2**k
        return []
    chosen = []
    for group in groups:
        if group.dtype in kernels.LOW_PRECISION:
            continue
        distinct = {id(g): g for g in group.grads if still_scaled is None or id(g) in still_scaled}
        if distinct:
            chosen.append(dataclasses.replace(group, grads=list(distinct.values())))
    return chosen


def _checked_by_one_optimizer(unscaled_by: list[tuple[SafeGradScaler, Any, set[int]]], clipped: set[int]) -> bool:
    """Whether every clipped parameter belongs to one optimizer already unscaled (its found_inf recorded).

    Its norms are float32, so the total is inf/NaN only when a gradient is: the
    optimizer skips its step whatever the clip does. Across optimizers a
    non-finite norm would zero the healthy one's gradients: the guard is needed.
    """
    holders = [ids for _, _, ids in unscaled_by if not ids.isdisjoint(clipped)]
    return len(holders) == 1 and clipped <= holders[0]


def scaled_total_norm(
    groups: list[kernels.Group], still_scaled: set[int] | None, scale: Tensor | None, norm_type: float
) -> Tensor:
    """The total norm of the unscaled gradients.

    ``still_scaled``: ids of the gradients that still carry ``scale`` (None: all
    of them); ``scale`` None: unknown, their norms are taken as they are.
    Still-scaled float32/float64 gradients are measured as the recipe measures
    them, multiplied by the inverse ``unscale_`` uses (:func:`_recipe_norms`);
    float16/bfloat16 ones by their float32 norms divided by the scale.
    """
    # The "0-norm" counts non-zeros: scale-free.
    scale_known = scale is not None and norm_type != 0.0
    first_device = groups[0].grads[0].device
    norms: list[Tensor] = []
    for group in groups:
        # Each tensor's norm at its place in the group, as torch stacks them (the sum's order is the recipe's).
        scaled_at = [i for i, g in enumerate(group.grads) if still_scaled is None or id(g) in still_scaled]
        plain_at = [i for i, g in enumerate(group.grads) if still_scaled is not None and id(g) not in still_scaled]
        placed: dict[int, Tensor] = {}
        if plain_at:
            placed.update(zip(plain_at, kernels.norms(group, [group.grads[i] for i in plain_at], norm_type)))
        if scaled_at:
            scaled = [group.grads[i] for i in scaled_at]
            if not scale_known:
                values = kernels.norms(group, scaled, norm_type)
            elif group.dtype not in kernels.LOW_PRECISION:
                assert scale is not None
                values = _recipe_norms(group, scaled, scale, norm_type)
            else:
                assert scale is not None
                stacked = torch.stack(kernels.norms(group, scaled, norm_type))
                values = list((stacked / scale.to(stacked.device)).unbind())
            placed.update(zip(scaled_at, values))
        norms.extend(placed[i] for i in range(len(group.grads)))
    total: Tensor = torch.linalg.vector_norm(torch.stack([norm.to(first_device) for norm in norms]), norm_type)
    return total


RECIPE_COPY_ELEMENTS = 1 << 24  # the unscaled copies' size at a time (64 MiB of float32)


def _recipe_norms(group: kernels.Group, grads: list[Tensor], scale: Tensor, norm_type: float) -> list[Tensor]:
    """Per-tensor norms of still-scaled gradients, taken as the recipe takes them: of the gradients times the
    inverse ``unscale_`` uses, in temporary copies (a chunk at a time), never in place.

    Dividing the scaled norm by the scale instead overflows where the recipe's
    does not (a still-scaled 1e20 gradient: its 2-norm squares to 1e40, past
    float32's 3.4e38, where the recipe's unscaled 1e17 gives 1e17), and a
    scaled inf would be all the scaler sees of a finite unscaled gradient.
    """
    inverse = scale.double().reciprocal().float().to(group.device)
    norms: list[Tensor] = []
    chunk: list[Tensor] = []
    elements = 0
    for position, grad in enumerate(grads):
        chunk.append(grad)
        elements += grad.numel()
        if elements >= RECIPE_COPY_ELEMENTS or position == len(grads) - 1:
            copies = list(torch._foreach_mul(chunk, inverse)) if group.foreach else [g * inverse for g in chunk]
            norms.extend(kernels.norms(group, copies, norm_type))
            chunk, elements = [], 0
    return norms


def scaled_threshold(scaler: SafeGradScaler) -> bool:
    """Whether ``max_norm`` is a threshold for the still-scaled gradients (see the module docstring).

    It is when the caller read ``scaler.get_scale()`` after ``scale()`` in this
    iteration: the idiom from before ``unscale_`` existed,
    ``clip_grad_norm_(params, max_norm * scaler.get_scale())``, still in torch's
    own tests. ``inf * scaler.get_scale()`` is such a threshold too: the norm
    returned is then torch's, that of the scaled gradients.
    """
    return scaler.view().scale_read
