"""Optimizer state carried across a rebuild of the masters: masters made earlier, state made before them."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor


def cast_state(saved: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """A parameter's optimizer state as torch would hold it for a ``dtype`` parameter (``step`` stays as it is)."""
    return {key: value if key == "step" else _cast(value, dtype) for key, value in saved.items()}


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """``value`` in ``dtype``; lists and tuples of tensors too (LBFGS keeps ``old_dirs``, ``old_stps``, ``ro``, ``al``)."""
    if torch.is_tensor(value):
        return value.to(dtype) if value.is_floating_point() else value
    if type(value) in (list, tuple):
        return type(value)(_cast(item, dtype) for item in value)
    return value


def earlier_masters(optimizer: Any, earlier: dict[int, tuple[weakref.ref[Tensor], Tensor]]) -> dict[int, Tensor]:
    """The masters made earlier for parameters of ``param_groups`` (still the same objects): id -> master."""
    found = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            made = earlier.get(id(param))
            if made is not None and made[1].shape == param.shape and made[0]() is param:
                found[id(param)] = made[1]
    return found


def move_state_to_masters(optimizer: Any, made: dict[int, Tensor]) -> None:
    """State the optimizer holds for a parameter that gets a new master goes to the master, as float32.

    (Stepped before ampguard was installed, or before ``uninstall()``/``install()``: the reverse of :func:`~ampguard.master_weights.records.retire`.)
    """
    if not optimizer.state:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            master = made.get(id(param))
            if master is not None and param in optimizer.state and master not in optimizer.state:
                optimizer.state[master] = cast_state(optimizer.state.pop(param), master.dtype)
