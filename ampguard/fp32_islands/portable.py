"""A model saved, scripted or exported while it holds ampguard's hooks comes out as torch would make it.

An island's hooks (:mod:`ampguard.fp32_islands.island_hooks`) and the input keeper
(:mod:`ampguard.fp32_islands.model_inputs`) are objects of ampguard in the model's
hook dictionaries: ``torch.save(model)`` pickled them (the file then needed
ampguard to load) and ``torch.jit.script`` refused them (it compiles hooks). While
``torch.save``, ``torch.jit.script`` or ``torch.export.export`` runs, ampguard's hooks
are taken off every module it is given (a module, or modules in dicts, lists and
tuples), and ampguard's global module hooks (the headroom watch's and the underflow
sample's, armed from one update to the next forward) out of torch's tables, and put
back after, in their order: what is written or traced is the model as torch trains
it (its islands are in the scaler's state, re-applied at the next forward after a
resume). torch 2.14's ``torch.export.export(..., strict=True)`` refused a model
while any global module hook was registered (``torch.onnx.export`` calls it too).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ampguard.fp32_islands.island_hooks import EnterFloat32, LeaveFloat32
from ampguard.fp32_islands.model_inputs import KeepInputs
from ampguard.fp32_islands.zero3 import GatheredToFloat32, ReleaseFloat32
from ampguard.module_hooks import global_hooks_lifted

OURS = (EnterFloat32, LeaveFloat32, KeepInputs, GatheredToFloat32, ReleaseFloat32)
HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")
FLAG_DICTS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
DEPTH = 3  # containers looked into: a checkpoint dict holding the model and an EMA


def without_our_hooks(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function(obj, ...)`` run with ampguard's hooks off the modules in ``obj``."""

    @functools.wraps(function)
    def call(obj: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            taken = _take_off(obj)
        except Exception:  # never the reason a save fails: torch's call as it is
            taken = []
        try:
            with global_hooks_lifted():
                return function(obj, *args, **kwargs)
        finally:
            for module, saved in taken:
                for name, entries in saved.items():
                    table = getattr(module, name)
                    table.clear()
                    table.update(entries)

    return call


def _modules(obj: Any, depth: int = DEPTH) -> Iterator[torch.nn.Module]:
    if isinstance(obj, torch.nn.Module):
        yield from obj.modules()
    elif depth and isinstance(obj, dict):
        for value in obj.values():
            yield from _modules(value, depth - 1)
    elif depth and isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _modules(value, depth - 1)


def _take_off(obj: Any) -> list[tuple[torch.nn.Module, dict[str, dict[int, Any]]]]:
    taken = []
    for module in _modules(obj):
        ours = [key for name in HOOK_DICTS for key, hook in getattr(module, name).items() if isinstance(hook, OURS)]
        if not ours:
            continue
        saved = {name: dict(getattr(module, name)) for name in (*HOOK_DICTS, *FLAG_DICTS) if hasattr(module, name)}
        taken.append((module, saved))
        for name in saved:
            table = getattr(module, name)
            for key in ours:
                table.pop(key, None)
    return taken
