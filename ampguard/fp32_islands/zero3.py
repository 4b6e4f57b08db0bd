"""fp32 islands inside a DeepSpeed ZeRO-3 model: float32 copies of parameters made after DeepSpeed gathers them.

ZeRO-3 partitions each parameter across the ranks (``param.ds_id`` marks one;
between calls ``param.data`` is an empty tensor) and gathers a module's own
parameters in a forward pre-hook of that module, registered when the engine
was built, and frees them in its forward hook. An island's pre-hook runs first
(ahead of every other) and so cannot copy them there
(:func:`ampguard.fp32_islands.half_parameters.upcast` leaves such parameters alone).
Instead, every module of the island that owns partitioned half-precision
parameters gets two hooks of its own:

* :class:`GatheredToFloat32`, a forward pre-hook registered after DeepSpeed's
  (so it runs after the gather): its own half-precision parameters are replaced
  in its ``_parameters`` by float32 copies (``p.float()``, part of the autograd
  graph: the gradient flows back to the gathered parameter, where DeepSpeed's
  own backward hooks gather it again and reduce its gradient as usual);
* :class:`ReleaseFloat32`, a forward hook put first (``always_call``): the
  parameters are put back before DeepSpeed's hook frees them.

They hold no state (a model holding them pickles) and are removed with the
island; copies of the model made while it had them lose them at uninstall
(:func:`strip`), and ``torch.save`` does not write them
(:mod:`ampguard.fp32_islands.portable`).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ampguard.fp32_islands.half_parameters import LOW_PRECISION, Upcast, restore
from ampguard.module_hooks import ModuleHook, remove_module_hooks
from ampguard.torch_privates import is_compiling

_calls = threading.local()  # per thread: (module, what was swapped) for each call in progress


def partitioned(tensor: torch.Tensor | None) -> bool:
    """Whether ``tensor`` is a parameter DeepSpeed ZeRO-3 partitions (gathered in its module's own hooks)."""
    return tensor is not None and hasattr(tensor, "ds_id")


def owners(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules under ``module`` (itself included) owning partitioned half-precision parameters."""
    return [
        owner
        for owner in module.modules()
        if any(partitioned(p) and p.dtype in LOW_PRECISION for p in owner._parameters.values() if p is not None)
    ]


class GatheredToFloat32(ModuleHook):
    """Forward pre-hook, after DeepSpeed's: the module's own gathered half-precision parameters as float32 copies."""

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        if is_compiling():  # inside compiled code the island does not apply (island_hooks)
            return
        swapped = Upcast()
        entries: dict[str, Any] = module._parameters
        for key, tensor in entries.items():
            if partitioned(tensor) and tensor is not None and tensor.dtype in LOW_PRECISION:
                entries[key] = tensor.float()  # an existing key: the dict is not resized under the loop
                swapped.parameters.append((entries, key, tensor))
        _calls.__dict__.setdefault("stack", []).append((module, swapped))


class ReleaseFloat32(ModuleHook):
    """Forward hook (``always_call``), ahead of DeepSpeed's: the partitioned parameters back in place."""

    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if is_compiling():
            return
        stack = _calls.__dict__.get("stack")
        if stack and stack[-1][0] is module:
            restore(stack.pop()[1])


def attach(module: torch.nn.Module) -> list[Any]:
    """The two hooks on each module of the island ``module`` owning partitioned parameters; their handles."""
    handles = []
    for owner in owners(module):
        handles.append(owner.register_forward_pre_hook(GatheredToFloat32()))
        handles.append(owner.register_forward_hook(ReleaseFloat32(), prepend=True, always_call=True))
    return handles


def strip(module: torch.nn.Module) -> bool:
    """Take these hooks off ``module`` (those a deepcopy carried). True if it had any."""
    return remove_module_hooks(module, pre=GatheredToFloat32, post=ReleaseFloat32)
