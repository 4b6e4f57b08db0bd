"""torch's clipping algorithm, with float32 norms for float16 and bfloat16 gradients.

torch groups the gradients by device and dtype, and checks foreach support,
once for the norms and again for the multiplication; here both are done once.
The operations on the tensors are torch's, so that float32 gradients without
a scaler give torch's bits.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

import ampguard.containment as containment

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


LOW_PRECISION = (torch.float16, torch.bfloat16)


PLAIN_TENSOR_TYPES = (Tensor, torch.nn.Parameter)


NONFINITE_ERROR = (
    "The total norm of order {norm_type} for gradients from "
    "`parameters` is non-finite, so it cannot be clipped. To disable "
    "this error and scale the gradients by the non-finite norm anyway, "
    "set `error_if_nonfinite=False`"
)


@dataclass
class Group:
    device: torch.device
    dtype: torch.dtype
    grads: list[Tensor]
    foreach: bool


def groups(grads: list[Tensor], foreach: bool | None) -> list[Group]:
    result = []
    for (device, dtype), device_grads in _group(grads):
        use_foreach = bool(
            (foreach is None and _has_foreach_support(device_grads, device))
            or (foreach and _device_has_foreach_support(device))
        )
        if foreach and not use_foreach:
            raise containment.intended(
                RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
            )
        result.append(Group(device, dtype, device_grads, use_foreach))
    return result


def norms(group: Group, grads: list[Tensor], norm_type: float) -> list[Tensor]:
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


def total_norm(groups: list[Group], norm_type: float) -> Tensor:
    """torch's total: the per-tensor norms, group by group, stacked on the first gradient's device."""
    per_tensor = [norm for group in groups for norm in norms(group, group.grads, norm_type)]
    first_device = groups[0].grads[0].device
    total: Tensor = torch.linalg.vector_norm(torch.stack([norm.to(first_device) for norm in per_tensor]), norm_type)
    return total


def clip_coefficient(max_norm: float | Tensor, total: Tensor) -> Tensor:
    # torch's expression: no branch, so no host read.
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def multiply_(groups: list[Group], coefficient: Tensor) -> None:
    for group in groups:
        on_device = coefficient.to(group.device)
        if group.foreach:
            torch._foreach_mul_(group.grads, on_device)
        else:
            for g in group.grads:
                g.mul_(on_device)


def raise_if_nonfinite(total: Tensor, norm_type: float) -> None:
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


def plain_gradients(pairs: list[tuple[Tensor, Tensor]]) -> bool:
    """Whether every gradient is a plain tensor (no DTensor or other subclass: torch's clip handles those)."""
    for _, gradient in pairs:  # noqa: SIM110  (a loop, no generator frame per gradient: it runs at every clip)
        if type(gradient) not in PLAIN_TENSOR_TYPES:
            return False
    return True


def materialize(parameters: Tensor | Iterable[Tensor]) -> tuple[Sequence[Tensor], Any]:
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
