"""Safe gradient clipping: what ``torch.nn.utils.clip_grad_norm_`` does under ampguard.

The documented AMP recipe is scale -> backward -> unscale_ -> clip -> step.
Under ampguard the clip is right whatever the caller did:

* **Still-scaled gradients** (``unscale_`` forgotten, Lightning manual
  optimisation, a library that clips before stepping): when a
  :class:`~ampguard.SafeGradScaler` scaled a loss this iteration and the
  parameters are not owned by an optimizer it already unscaled, the total norm
  is computed from the scaled gradients and divided by the scale on the device.
  The clip coefficient is multiplied into the still-scaled gradients, and the
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

The computation is torch's (same operations, the gradients grouped by device
and dtype once instead of twice) except for the float32 norms, the division by
the scale and the NaN coefficient: with float32 gradients, no scaler and finite
norms the result is bit-identical to torch's. docs/clipping.md has the details
and the measured cost.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
import wrapt
from torch import Tensor

from ampguard import containment, master_weights, summary
from ampguard.log import RateLimiter, is_rank_zero, logger
from ampguard.scaler import SafeGradScaler, live_scalers, params_of, scalers_in_iteration
from ampguard.stats import process_counters

try:  # private torch helpers, present 2.3 .. 2.14; clip_grad_norm_ itself uses them
    from torch.utils._foreach_utils import (
        _device_has_foreach_support,
        _group_tensors_by_device_and_dtype,
        _has_foreach_support,
    )
except ImportError:  # pragma: no cover - a future torch
    _group_tensors_by_device_and_dtype = None  # type: ignore[assignment]

    def _device_has_foreach_support(device: torch.device) -> bool:
        return device.type in ("cpu", "cuda")

    def _has_foreach_support(tensors: list[Tensor], device: torch.device) -> bool:
        return _device_has_foreach_support(device) and all(type(t) in (Tensor, torch.nn.Parameter) for t in tensors)


_WRAPT_DIR = os.path.dirname(wrapt.__file__)

LOW_PRECISION = (torch.float16, torch.bfloat16)
_PLAIN_TENSOR_TYPES = (Tensor, torch.nn.Parameter)

SKIP_LOG_INTERVAL = 60.0  # seconds between two "step skipped" warnings

NONFINITE_ERROR = (
    "The total norm of order {norm_type} for gradients from "
    "`parameters` is non-finite, so it cannot be clipped. To disable "
    "this error and scale the gradients by the non-finite norm anyway, "
    "set `error_if_nonfinite=False`"
)

SKIPPED_STEP = (
    "clip_grad_norm_: the total gradient norm is {norm} and no GradScaler is in play (bf16/fp32 training): "
    "this optimizer step is skipped (the gradients of the {count} clipped parameters are set to None, "
    "so the optimizer changes neither the parameters nor its state). {total} step(s) skipped so far "
    "(ampguard.stats.process_counters.clip_skipped){suppressed}. Likely causes: a bad batch, a learning rate "
    "too high, an fp16 overflow in a model run without a GradScaler."
)

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


class _State:
    """What the clip patch set up: read on every call, so plain attributes."""

    def __init__(self) -> None:
        self.active = False
        self.original: Callable[..., Tensor] | None = None  # torch's clip_grad_norm_
        self.deprecation: tuple[type[Warning], str] | None = None  # what torch's clip_grad_norm warns
        # The no-scaler guard: on only when the grad_scaler patch is applied, so
        # that every GradScaler is a SafeGradScaler and "none in
        # scalers_in_iteration" means "no loss was scaled".
        self.guard = False
        self.foreign_scaler = False
        self.skip_log = RateLimiter(SKIP_LOG_INTERVAL)
        self.warned_ambiguous = False
        # bf16/fp32 training has no scaler, hence no scaler stats line: the
        # guard logs its own every `stats_every` calls (AMPGUARD_STATS_EVERY).
        self.stats_every = 0
        self.guarded_calls = 0


state = _State()


def activate(
    original: Callable[..., Tensor],
    *,
    guard: bool,
    deprecation: tuple[type[Warning], str] | None = None,
    stats_every: int = 0,
) -> None:
    """Turn the safe clip on (called by the clip_grad patch with torch's ``clip_grad_norm_``)."""
    state.active = True
    state.stats_every = stats_every
    state.guarded_calls = 0
    state.original = original
    state.deprecation = deprecation
    state.guard = guard
    state.foreign_scaler = False
    state.skip_log = RateLimiter(SKIP_LOG_INTERVAL)
    state.warned_ambiguous = False


def deactivate() -> None:
    """Turn it off: wrappers still held somewhere call torch's function unchanged."""
    state.active = False
    state.guard = False


def guard_active() -> bool:
    """Whether a non-finite norm with no scaler in play skips the step right now."""
    return state.active and state.guard and not state.foreign_scaler


# -- the wrappers ---------------------------------------------------------------------


def safe_function_wrapper(
    original: Callable[..., Any], wrapper: Callable[..., Any], *, idle: Callable[[], bool] | None = None
) -> wrapt.FunctionWrapper[Any, Any]:
    """``wrapt.FunctionWrapper(original, wrapper)``, made to behave under torch.compile, copy and pickle.

    ``idle()`` true means that ``wrapper`` would only call ``original``: the
    call then goes to ``original`` directly (the idle path costs one Python frame).

    * A plain FunctionWrapper passes ``isinstance(w, types.FunctionType)`` (it
      proxies ``__class__``), so dynamo takes it for torch's function, inlines
      that code and then fails building a closure guard on the proxy ("Guard
      failed on the same frame it was created"). This one reports its own
      class; dynamo traces its ``__call__``, which, while compiling, is torch's
      function itself: compiled code (fullgraph included) clips as torch does.
    * ``copy``/``deepcopy`` return the wrapper itself and pickling stores a
      reference to the module attribute, as for a function (wrapt refuses both).
    """

    class SafeFunctionWrapper(wrapt.FunctionWrapper[Any, Any]):
        @property  # type: ignore[misc]
        def __class__(self) -> type:
            return type(self)

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling() or (idle is not None and idle()):
                return original(*args, **kwargs)
            return wrapt.FunctionWrapper.__call__(self, *args, **kwargs)

        def __copy__(self) -> SafeFunctionWrapper:
            return self

        def __deepcopy__(self, memo: dict[int, Any]) -> SafeFunctionWrapper:
            return self

        def __reduce_ex__(self, protocol: Any) -> str:
            return self.__wrapped__.__qualname__

    SafeFunctionWrapper.__name__ = SafeFunctionWrapper.__qualname__ = "SafeFunctionWrapper"
    return SafeFunctionWrapper(original, wrapper)


def idle() -> bool:
    """Nothing for the safe clip to do: no SafeGradScaler scaled a loss and the no-scaler guard is off.

    O(1): then ``clip_grad_norm_`` is torch's function, untouched.
    """
    return not state.active or (not (state.guard and not state.foreign_scaler) and not scalers_in_iteration)


_Wrapper = TypeVar("_Wrapper", bound=Callable[..., Any])


def contained(where: str) -> Callable[[_Wrapper], _Wrapper]:
    """For a wrapt wrapper of a clip function: a failure of ampguard's code falls back to torch's function.

    The wrapper is handed torch's function through :func:`containment.torch_call`,
    so torch's own errors reach the caller unchanged; parameters given as a
    generator are read once here, so that the fallback gets them all again.
    """

    def decorate(inner: _Wrapper) -> _Wrapper:
        @functools.wraps(inner)
        def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            args, kwargs, again = _generator_read_once(args, kwargs)
            try:
                return inner(functools.partial(containment.torch_call, wrapped), instance, args, kwargs)
            except Exception as error:
                passing = containment.passes_through(error)
                if passing is not None:
                    raise passing from None
                containment.report(where, error)
                args, kwargs = again()
                return wrapped(*args, **kwargs)

        return cast(_Wrapper, wrapper)

    return decorate


def _generator_read_once(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]]:
    """``args``/``kwargs`` with a generator of parameters replaced by a fresh one, and a way to get another."""
    positional = bool(args) and isinstance(args[0], types.GeneratorType)
    key = None if positional else next((k for k, v in kwargs.items() if isinstance(v, types.GeneratorType)), None)
    if not positional and key is None:
        return args, kwargs, lambda: (args, kwargs)
    items = list(args[0] if key is None else kwargs[key])

    def fresh() -> tuple[tuple[Any, ...], dict[str, Any]]:
        if key is None:
            return ((p for p in items), *args[1:]), kwargs
        return args, {**kwargs, key: (p for p in items)}

    new_args, new_kwargs = fresh()
    return new_args, new_kwargs, fresh


@contained("safe clip_grad_norm_")
def clip_grad_norm_wrapper(
    wrapped: Callable[..., Tensor], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Tensor:
    """wrapt wrapper of ``torch.nn.utils.clip_grad_norm_``."""
    if instance is not None or idle():
        return wrapped(*args, **kwargs)
    try:
        parameters, max_norm, norm_type, error_if_nonfinite, foreach = _bind(*args, **kwargs)
    except TypeError:  # torch raises its own error, or knows an argument this torch added
        return wrapped(*args, **kwargs)
    return safe_clip_grad_norm_(
        parameters, max_norm, norm_type, error_if_nonfinite, foreach, torch_clip_grad_norm_=wrapped
    )


def deprecated_clip_grad_norm_wrapper(
    wrapped: Callable[..., Tensor], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Tensor:
    """wrapt wrapper of the deprecated ``torch.nn.utils.clip_grad_norm``.

    torch's function warns, then calls ``clip_grad_norm_``. Calling it from
    here would attribute its warning to this file, so the wrapper issues
    torch's warning (as recorded by :func:`record_deprecation`) at the caller
    and calls the safe ``clip_grad_norm_`` itself.
    """
    deprecation = state.deprecation
    if not state.active or instance is not None or deprecation is None:
        return wrapped(*args, **kwargs)
    try:
        _bind(*args, **kwargs)
    except TypeError:
        return wrapped(*args, **kwargs)  # torch's own error, from torch's own function
    warnings.warn(deprecation[1], deprecation[0], stacklevel=_caller_stacklevel())
    safe = torch.nn.utils.clip_grad.clip_grad_norm_
    if not isinstance(safe, wrapt.FunctionWrapper):  # somebody replaced it since
        safe = state.original or safe
        return clip_grad_norm_wrapper(safe, None, args, kwargs)
    result: Tensor = safe(*args, **kwargs)
    return result


def record_deprecation(deprecated: Callable[..., Tensor]) -> tuple[type[Warning], str] | None:
    """The warning torch's deprecated ``clip_grad_norm`` issues (its category and message differ by release)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            deprecated([], 1.0)  # no parameters: nothing is computed or changed
        except Exception:
            return None
    for warning in caught:
        if "deprecated" in str(warning.message):
            return warning.category, str(warning.message)
    return None


def _caller_stacklevel() -> int:
    """``stacklevel`` that makes a warning issued by a wrapper here point at the wrapper's caller."""
    level = 1
    frame: types.FrameType | None = sys._getframe(1)
    # Skip this module's frames and wrapt's (when it runs without its C extension).
    while frame is not None and (
        frame.f_code.co_filename == __file__ or frame.f_code.co_filename.startswith(_WRAPT_DIR)
    ):
        frame = frame.f_back
        level += 1
    return level


def _bind(
    parameters: Tensor | Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> tuple[Tensor | Iterable[Tensor], float, float, bool, bool | None]:
    return parameters, max_norm, norm_type, error_if_nonfinite, foreach


def scale_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """``GradScaler.scale`` of torch's class, noting a scaler that is not a SafeGradScaler."""

    @functools.wraps(original)
    def scale(self: Any, outputs: Any) -> Any:
        if (
            not state.foreign_scaler
            and state.active
            and getattr(self, "_enabled", False)
            and not isinstance(self, SafeGradScaler)
        ):
            state.foreign_scaler = True
            if state.guard:
                logger.warning(FOREIGN_SCALER.format(kind=f"{type(self).__module__}.{type(self).__qualname__}"))
        return original(self, outputs)

    return scale


# -- the safe clip --------------------------------------------------------------------


def safe_clip_grad_norm_(
    parameters: Tensor | Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    torch_clip_grad_norm_: Callable[..., Tensor] | None = None,
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` made safe (see the module docstring).

    Arguments and return value are torch's; the returned norm is that of the
    unscaled gradients, in float32 when they are float16/bfloat16.
    ``torch_clip_grad_norm_`` is torch's original function, used where
    ampguard has nothing to add (no gradient at all, tensor subclasses such as
    DTensor, a GradScaler ampguard does not know).
    """
    torch_clip = torch_clip_grad_norm_ or _original_clip_grad_norm_()
    params, for_torch = _materialize(parameters)
    pairs = master_weights.gradient_pairs(params)  # a master's float32 gradient once unscale_ put it there
    if not pairs or any(type(g) not in _PLAIN_TENSOR_TYPES for _, g in pairs):
        return containment.torch_call(torch_clip, for_torch, max_norm, norm_type, error_if_nonfinite, foreach)
    scalers = scalers_in_play()
    if not scalers and not guard_active():
        return containment.torch_call(torch_clip, for_torch, max_norm, norm_type, error_if_nonfinite, foreach)
    max_norm = float(max_norm)
    norm_type = float(norm_type)
    with torch.no_grad():
        if scalers:
            return _clip_with_scaler(pairs, scalers, max_norm, norm_type, error_if_nonfinite, foreach)
        return _clip_without_scaler(pairs, max_norm, norm_type, error_if_nonfinite, foreach)


def scalers_in_play() -> list[SafeGradScaler]:
    """The SafeGradScalers that scaled a loss in this iteration (in this thread when several threads scale)."""
    scalers = [s for s in live_scalers() if getattr(s, "_scale", None) is not None]
    if len(scalers) > 1:  # threads training models of their own: each clips with its own scaler
        here = threading.get_ident()
        scalers = [s for s in scalers if s._iteration.scaling_thread == here] or scalers
    return scalers


def unscaled_optimizers(scalers: list[SafeGradScaler]) -> list[tuple[SafeGradScaler, Any, set[int]]]:
    """``(scaler, optimizer, ids of its parameters)`` for every optimizer the scalers already unscaled."""
    return [
        (scaler, optimizer, params_of([optimizer]))
        for scaler in scalers
        for optimizer in scaler._iteration.unscaled_optimizers
    ]


def single_scale(scalers: list[SafeGradScaler]) -> Tensor | None:
    """The scale still-scaled gradients carry: None when several scalers are in play (one WARNING)."""
    if len(scalers) == 1:
        return scalers[0]._scale
    if not state.warned_ambiguous:
        state.warned_ambiguous = True
        logger.warning(AMBIGUOUS_SCALERS.format(count=len(scalers)))
    return None


def _clip_with_scaler(
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
    # None: every gradient is still scaled (unscale_ forgotten, the common case).
    still_scaled = {id(g) for p, g in pairs if id(p) not in unscaled_params} if unscaled_params else None
    scale = single_scale(scalers) if still_scaled is None or still_scaled else None
    groups = _groups(grads, foreach)
    total, scaled_vector = scaled_total_norm(groups, still_scaled, scale, norm_type)
    scale_known = scale is not None and norm_type != 0.0
    first_device = grads[0].device
    threshold: float | Tensor = max_norm
    if scale_known and _scaled_threshold(scalers[0], max_norm):
        if still_scaled is None:
            # Every gradient still scaled: torch's own total and coefficient, bit for bit.
            total = torch.linalg.vector_norm(scaled_vector, norm_type)
        else:
            assert scale is not None  # (scale_known)
            threshold = max_norm / scale.to(first_device)
    if error_if_nonfinite:
        _raise_if_nonfinite(total, norm_type)
    clipped = {id(p) for p, _ in pairs}
    if _checked_by_one_optimizer(unscaled_by, clipped):
        # The recipe's case: every clipped gradient was checked by one optimizer's unscale_, so a
        # non-finite norm means a non-finite gradient that optimizer already skips for: torch's kernels.
        _multiply_(groups, _clip_coefficient(threshold, total))
        return total
    # total - total is 0 for a finite norm and NaN for an inf/NaN one (2 kernels here, against 5 for
    # isfinite + div): added to the coefficient it leaves it unchanged or makes it NaN, and every
    # clipped step is skipped.
    nan_if_nonfinite = total - total
    coefficient = _clip_coefficient(threshold, total) + nan_if_nonfinite
    _multiply_(groups, coefficient)
    if unscaled_by:
        _raise_found_inf(unscaled_by, clipped, nan_if_nonfinite)
    return total


def _checked_by_one_optimizer(unscaled_by: list[tuple[SafeGradScaler, Any, set[int]]], clipped: set[int]) -> bool:
    """Whether every clipped parameter belongs to one optimizer already unscaled (its found_inf recorded).

    Its norms are float32, so the total is inf/NaN only when a gradient is: the
    optimizer skips its step whatever the clip does. Across optimizers a
    non-finite norm would zero the healthy one's gradients: the guard is needed.
    """
    holders = [ids for _, _, ids in unscaled_by if not ids.isdisjoint(clipped)]
    return len(holders) == 1 and clipped <= holders[0]


def scaled_total_norm(
    groups: list[_Group], still_scaled: set[int] | None, scale: Tensor | None, norm_type: float
) -> tuple[Tensor, Tensor | None]:
    """The total norm of the unscaled gradients, and the vector of the still-scaled ones' norms (None if none).

    ``still_scaled``: ids of the gradients that still carry ``scale`` (None: all
    of them); ``scale`` None: unknown, their norms are taken as they are.
    """
    unscaled_norms: list[Tensor] = []
    scaled_norms: list[Tensor] = []
    for group in groups:
        if still_scaled is None:
            scaled_norms.extend(_norms(group, group.grads, norm_type))
            continue
        scaled = [g for g in group.grads if id(g) in still_scaled]
        unscaled = [g for g in group.grads if id(g) not in still_scaled]
        if unscaled:
            unscaled_norms.extend(_norms(group, unscaled, norm_type))
        if scaled:
            scaled_norms.extend(_norms(group, scaled, norm_type))
    first_device = groups[0].grads[0].device
    vectors = []
    if unscaled_norms:
        vectors.append(torch.stack([norm.to(first_device) for norm in unscaled_norms]))
    # The "0-norm" counts non-zeros: scale-free.
    scale_known = scale is not None and norm_type != 0.0
    scaled_vector: Tensor | None = None
    if scaled_norms:
        vector = scaled_vector = torch.stack([norm.to(first_device) for norm in scaled_norms])
        if scale_known:
            assert scale is not None
            vector = vector / scale.to(first_device)
        vectors.append(vector)
    total = torch.linalg.vector_norm(vectors[0] if len(vectors) == 1 else torch.cat(vectors), norm_type)
    return total, scaled_vector


def _scaled_threshold(scaler: SafeGradScaler, max_norm: float) -> bool:
    """Whether ``max_norm`` is a threshold for the still-scaled gradients (see the module docstring).

    It is when the caller read ``scaler.get_scale()`` after ``scale()`` in this
    iteration: the idiom from before ``unscale_`` existed,
    ``clip_grad_norm_(params, max_norm * scaler.get_scale())``, still in torch's
    own tests. ``max_norm=inf`` means the same either way.
    """
    return scaler._iteration.scale_read and math.isfinite(max_norm)


def _raise_found_inf(
    unscaled_by: list[tuple[SafeGradScaler, Any, set[int]]], clipped: set[int], nan_if_nonfinite: Tensor
) -> None:
    """Optimizers already unscaled have their found_inf recorded; a non-finite norm must skip them too."""
    nonfinite = torch.nan_to_num(nan_if_nonfinite, nan=1.0)  # 1.0 for a non-finite norm, else 0.0
    for scaler, optimizer, ids in unscaled_by:
        if ids.isdisjoint(clipped):
            continue
        optimizer_state = scaler._per_optimizer_states.get(id(optimizer))  # .get: never create an entry
        if optimizer_state is None:
            continue
        for found_inf in optimizer_state["found_inf_per_device"].values():
            torch.maximum(found_inf, nonfinite.to(device=found_inf.device, dtype=found_inf.dtype), out=found_inf)


def _clip_without_scaler(
    pairs: list[tuple[Tensor, Tensor]],
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    foreach: bool | None,
) -> Tensor:
    """No loss was scaled (bf16 / fp32 training): a non-finite norm skips the step. One host read."""
    grads = [g for _, g in pairs]
    groups = _groups(grads, foreach)
    norms = [norm for group in groups for norm in _norms(group, group.grads, norm_type)]
    first_device = grads[0].device
    total: Tensor = torch.linalg.vector_norm(torch.stack([norm.to(first_device) for norm in norms]), norm_type)
    if error_if_nonfinite:
        _raise_if_nonfinite(total, norm_type)  # torch's host read; finite from here on
        _multiply_(groups, _clip_coefficient(max_norm, total))
        return total
    # Queue the multiplication before reading, so that on a GPU it overlaps the read.
    _multiply_(groups, _clip_coefficient(max_norm, total))
    norm = float(total)
    if not math.isfinite(norm):
        _skip_step(pairs, norm)
    state.guarded_calls += 1
    if state.stats_every and state.guarded_calls % state.stats_every == 0:
        _log_guard_stats()
    return total


def _log_guard_stats() -> None:
    if is_rank_zero() and logger.isEnabledFor(logging.INFO):
        logger.info("stats clip_calls=%d clip_skipped=%d", state.guarded_calls, process_counters.clip_skipped)


def _skip_step(pairs: list[tuple[Tensor, Tensor]], norm: float) -> None:
    for param, _ in pairs:
        param.grad = None
    process_counters.clip_skipped += 1
    summary.arm()
    limiter = state.skip_log
    suppressed_before = limiter.suppressed
    if limiter.ready():
        suppressed = f"; {suppressed_before} similar message(s) suppressed" if suppressed_before else ""
        limiter.suppressed = 0
        logger.warning(
            SKIPPED_STEP.format(norm=norm, count=len(pairs), total=process_counters.clip_skipped, suppressed=suppressed)
        )


# -- torch's algorithm, with float32 norms --------------------------------------------
#
# torch groups the gradients by device and dtype, and checks foreach support,
# once for the norms and again for the multiplication; here both are done once.
# The operations on the tensors are torch's, so that float32 gradients without
# a scaler give torch's bits.


@dataclass
class _Group:
    device: torch.device
    dtype: torch.dtype
    grads: list[Tensor]
    foreach: bool


def _groups(grads: list[Tensor], foreach: bool | None) -> list[_Group]:
    groups = []
    for (device, dtype), device_grads in _group(grads):
        use_foreach = bool(
            (foreach is None and _has_foreach_support(device_grads, device))
            or (foreach and _device_has_foreach_support(device))
        )
        if foreach and not use_foreach:
            raise containment.intended(
                RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
            )
        groups.append(_Group(device, dtype, device_grads, use_foreach))
    return groups


def _norms(group: _Group, grads: list[Tensor], norm_type: float) -> list[Tensor]:
    """Per-tensor norms of ``grads`` (all of ``group``'s device and dtype): float32 for float16/bfloat16."""
    low = group.dtype in LOW_PRECISION
    if group.foreach:
        if not low:
            return list(torch._foreach_norm(grads, norm_type))
        if _foreach_norm_takes_dtype():
            return list(torch._foreach_norm(grads, norm_type, dtype=torch.float32))
    if low:
        return [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads]
    return [torch.linalg.vector_norm(g, norm_type) for g in grads]


def _clip_coefficient(max_norm: float | Tensor, total: Tensor) -> Tensor:
    # torch's expression: no branch, so no host read.
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def _multiply_(groups: list[_Group], coefficient: Tensor) -> None:
    for group in groups:
        on_device = coefficient.to(group.device)
        if group.foreach:
            torch._foreach_mul_(group.grads, on_device)
        else:
            for g in group.grads:
                g.mul_(on_device)


def _raise_if_nonfinite(total: Tensor, norm_type: float) -> None:
    if torch.logical_or(total.isnan(), total.isinf()):
        raise containment.intended(RuntimeError(NONFINITE_ERROR.format(norm_type=norm_type)))


def _group(tensors: list[Tensor]) -> list[tuple[tuple[torch.device, torch.dtype], list[Tensor]]]:
    """``[((device, dtype), tensors)]`` in first-seen order, as torch groups them."""
    if _group_tensors_by_device_and_dtype is not None:
        grouped = _group_tensors_by_device_and_dtype([cast(list[Tensor | None], tensors)])
        return [(key, cast(list[Tensor], lists[0])) for key, (lists, _) in grouped.items()]
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}  # type: ignore[unreachable]
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.items())


@functools.cache
def _foreach_norm_takes_dtype() -> bool:
    """``torch._foreach_norm(..., dtype=)`` exists from torch 2.4."""
    try:
        torch._foreach_norm([torch.ones(1, dtype=torch.float16)], 2.0, dtype=torch.float32)
    except (TypeError, RuntimeError):
        return False
    return True


def _materialize(parameters: Tensor | Iterable[Tensor]) -> tuple[Sequence[Tensor], Any]:
    """The parameters as a sequence, and what to hand torch in their place.

    A generator is read once; torch gets a fresh generator over the same
    parameters (it warns about an empty generator, and only about a generator).
    """
    if isinstance(parameters, Tensor):
        return [parameters], parameters
    if isinstance(parameters, (list, tuple)):
        return parameters, parameters
    params = list(parameters)
    if isinstance(parameters, types.GeneratorType):
        return params, (p for p in params)
    return params, params


def _original_clip_grad_norm_() -> Callable[..., Tensor]:
    return state.original if state.original is not None else torch.nn.utils.clip_grad.clip_grad_norm_
