"""Patch ``autocast``: the legacy ``torch.cuda.amp`` / ``torch.cpu.amp`` spellings without FutureWarnings.

torch 2.4 deprecated ``torch.cuda.amp.autocast``, ``torch.cpu.amp.autocast``,
``torch.cuda.amp.custom_fwd`` / ``custom_bwd`` and the legacy GradScaler
classes by wrapping them with ``typing_extensions.deprecated``; torch 2.10
wraps the autocast classes themselves (``__new__`` and ``__init_subclass__``,
so merely subclassing warns). The legacy classes already run on the modern
``torch.amp`` implementation; only the warning wrappers stand between a user
and silence.

This patch takes the wrappers off *in place*: the classes keep their identity,
which dynamo (it recognises autocast classes by identity and binds their
signature), TorchScript (by qualified name) and ``isinstance`` rely on. The
deprecated functions are replaced, under every name that holds them, by the
function the decorator wrapped.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ampguard.config import Config
from ampguard.patch import Patch

_WRAPPED_DUNDERS = ("__new__", "__init__", "__init_subclass__")


def _is_deprecation_wrapper(function: Any) -> bool:
    return callable(function) and hasattr(function, "__deprecated__") and hasattr(function, "__wrapped__")


def legacy_classes() -> list[type]:
    found = [torch.cuda.amp.autocast, torch.cpu.amp.autocast, torch.cuda.amp.GradScaler]  # type: ignore[attr-defined]
    cpu_scaler = getattr(torch.cpu.amp, "GradScaler", None)  # torch >= 2.3
    if cpu_scaler is not None:
        found.append(cpu_scaler)
    return found


def legacy_functions() -> list[Any]:
    return [getattr(torch.cuda.amp, name) for name in ("custom_fwd", "custom_bwd") if hasattr(torch.cuda.amp, name)]


class AutocastPatch(Patch):
    name = "autocast"
    summary = "legacy torch.cuda.amp / torch.cpu.amp spellings run on torch.amp without FutureWarnings"
    requires_torch = ">=2.3"

    def apply(self, config: Config) -> None:
        for cls in legacy_classes():
            self._undeprecate_class(cls)
        for function in legacy_functions():
            if _is_deprecation_wrapper(function):
                self.bindings.rebind_names_of(function, inspect.unwrap(function))

    def _undeprecate_class(self, cls: type) -> None:
        for dunder in _WRAPPED_DUNDERS:
            descriptor = vars(cls).get(dunder)
            if descriptor is None:
                continue
            kind = type(descriptor)
            function = descriptor.__func__ if kind in (staticmethod, classmethod) else descriptor
            if not hasattr(function, "__deprecated__"):
                continue
            original = getattr(function, "__wrapped__", None)
            if original is None or original is object.__new__:
                # The wrapper stood in for an inherited method: deleting it restores that.
                self.bindings.delete_attribute(cls, dunder)
            elif kind in (staticmethod, classmethod):
                self.bindings.set_attribute(cls, dunder, kind(original))
            else:
                self.bindings.set_attribute(cls, dunder, original)
