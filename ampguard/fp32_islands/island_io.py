"""What an fp32 island does at its boundary: float32 in, the caller's dtypes out.

In: every floating tensor on the autocast device (except float64) in any
nesting of the inputs becomes float32, as ``torch.amp.custom_fwd(cast_inputs=
torch.float32)`` casts them (:func:`inputs_to_float32`).

Out: an island changes the precision inside the module, not the dtypes its
caller sees. Code written for autocast (an MoE dispatch ``out[mask] =
expert(x[mask])``, ``index_add_``, ``index_copy_``, ``scatter_``) needs the
float16 it had. So the probe records, for the call it blames, the dtype of each
floating output under autocast (:func:`output_kinds`: ``"autocast"`` for
autocast's own dtype, else the dtype's name), and the island gives its floating
outputs those dtypes again (:func:`outputs_as_recorded`): autocast's dtype *at
that call*, so an island trained under float16 gives bfloat16 under a bfloat16
autocast. A value out of float16's range becomes inf there: an overflow of the
caller, which the probe finds like any other. Without a record (an island made
by name only) the outputs stay as computed, float32.
"""

from __future__ import annotations

from typing import Any

import torch

from ampguard.fp32_islands.half_parameters import LOW_PRECISION
from ampguard.fp32_islands.tensor_tree import map_tensors, tensors, values_in

AUTOCAST = "autocast"  # an output that had autocast's dtype


def autocast_enabled(device_type: str) -> bool:
    try:
        return bool(torch.is_autocast_enabled(device_type))  # torch >= 2.4
    except TypeError:
        if device_type == "cpu":
            return bool(torch.is_autocast_cpu_enabled())
        return device_type == "cuda" and bool(torch.is_autocast_enabled())


def autocast_dtype(device_type: str) -> torch.dtype:
    get = getattr(torch, "get_autocast_dtype", None)  # torch >= 2.4
    if get is not None:
        return get(device_type)  # type: ignore[no-any-return]
    return torch.get_autocast_cpu_dtype() if device_type == "cpu" else torch.get_autocast_gpu_dtype()


def inputs_to_float32(value: Any, device_type: str) -> Any:
    """custom_fwd's cast: floating tensors on the autocast device, except float64, to float32 (at any depth)."""

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        eligible = (
            tensor.is_floating_point() and tensor.device.type == device_type and tensor.dtype is not torch.float64
        )
        return tensor.float() if eligible else tensor

    return map_tensors(value, cast)


def hides_half_inputs(cast: Any, device_type: str | None) -> bool:
    """Whether inputs already cast to float32 (``cast``) still hold a float16/bfloat16 tensor (on the autocast
    device; None: any device) inside an object no cast reaches (the instance attributes of a plain class): the
    island cannot run that call in float32, since the tensor would meet its float32 weights."""
    return any(
        tensor.dtype in LOW_PRECISION and (device_type is None or tensor.device.type == device_type)
        for tensor in values_in(cast)
    )


def low_precision_dtype(value: Any) -> torch.dtype | None:
    """The dtype of the first float16/bfloat16 tensor in ``value`` (any nesting), or None."""
    for tensor in tensors(value):
        if tensor.dtype in LOW_PRECISION:
            return tensor.dtype
    return None


def half_inputs_to_float32(value: Any) -> Any:
    """Without autocast: every float16/bfloat16 tensor in ``value`` (any nesting) to float32, the rest as it is."""
    return map_tensors(value, lambda tensor: tensor.float() if tensor.dtype in LOW_PRECISION else tensor)


def output_kinds(leaves: list[torch.Tensor]) -> tuple[str, ...] | None:
    """The dtype of each floating tensor of a module's output (``leaves``: its tensors) under autocast.

    Without autocast, each dtype's own name (a model stored in float16: ``"float16"``), which
    :func:`outputs_without_autocast` gives back.
    """
    floating = [t for t in leaves if t.is_floating_point()]
    if not floating:
        return ()
    device_type = floating[0].device.type
    own = autocast_dtype(device_type) if autocast_enabled(device_type) else None
    return tuple(AUTOCAST if t.dtype == own else str(t.dtype).replace("torch.", "") for t in floating)


def stored_without_autocast(kinds: tuple[str, ...] | None) -> str | None:
    """The half-precision dtype a module's outputs were recorded in without autocast (a model stored in it), or None.

    Under autocast a float16 output is recorded as autocast's own; a float16/bfloat16 output recorded by its name
    and no output recorded as autocast's is a model stored in half precision, run without autocast.
    """
    if not kinds or AUTOCAST in kinds:
        return None
    return next((kind for kind in kinds if kind in ("float16", "bfloat16")), None)


def outputs_as_recorded(output: Any, kinds: tuple[str, ...], own: torch.dtype) -> Any:
    """``output`` with its floating tensors in the recorded dtypes (``own``: autocast's dtype at this call).

    When the output has another number of floating tensors than recorded, one
    kind recorded for all of them applies to each; mixed kinds leave it as is.
    """
    floating = sum(1 for t in tensors(output) if t.is_floating_point())
    if floating != len(kinds):
        if len(set(kinds)) != 1:
            return output
        kinds = kinds[:1] * floating
    targets = iter(own if kind == AUTOCAST else getattr(torch, kind, None) for kind in kinds)

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_floating_point():
            return tensor
        target = next(targets)
        return tensor.to(target) if isinstance(target, torch.dtype) and target != tensor.dtype else tensor

    return map_tensors(output, cast)


def outputs_without_autocast(output: Any, kinds: tuple[str, ...] | None, own: torch.dtype) -> Any:
    """An island called without autocast: ``output`` in the dtypes recorded, or else its float32 tensors in ``own``.

    ``own``: the half-precision dtype the call came in with (its parameters', or else its inputs'). A kind
    recorded as autocast's (the island was made under autocast) is taken for ``own``. Without a record (an
    island made by name) every float32 output goes back to ``own``: the rest of a float16 model expects it.
    """
    if kinds is not None:
        return outputs_as_recorded(output, kinds, own)
    return map_tensors(output, lambda tensor: tensor.to(own) if tensor.dtype == torch.float32 else tensor)
