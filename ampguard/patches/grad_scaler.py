"""Patch ``grad_scaler``: every way of creating a GradScaler gives a SafeGradScaler.

* ``torch.amp.GradScaler``, ``torch.GradScaler``, ``torch.amp.grad_scaler.GradScaler``
  and every name bound to that class before ampguard was imported (including
  ``functools.partial(torch.GradScaler, ...)``, as the coqui trainer holds) become
  :class:`GradScaler`, a :class:`~ampguard.SafeGradScaler` subclass of its own
  (uninstall gives torch's class back to those names and to no other).
* ``torch.cuda.amp.GradScaler`` / ``torch.cpu.amp.GradScaler`` become
  SafeGradScaler subclasses with the legacy signature (init_scale first).
* FSDP's ``ShardedGradScaler``, whenever its module is imported, becomes a
  subclass that adds SafeGradScaler's safety and keeps its cross-rank
  all-reduce of found_inf.
"""

from __future__ import annotations

from typing import Any

import torch

import ampguard.torch_privates as torch_privates
from ampguard.config import Config
from ampguard.errors import PatchUnavailable
from ampguard.patch import Patch
from ampguard.patches.warning_attribution import attribute_past_ampguard
from ampguard.scaler import SafeGradScaler, TorchGradScaler, safe_sharded_scaler_class
from ampguard.scaler.sharded import is_safe_sharded

SHARDED_MODULE = "torch.distributed.fsdp.sharded_grad_scaler"


class GradScaler(SafeGradScaler):
    """``torch.amp.GradScaler`` (also ``torch.GradScaler``) under ampguard: a :class:`~ampguard.SafeGradScaler`.

    A class of its own rather than SafeGradScaler itself, so that uninstall can
    tell the names ampguard rebound (given torch's class back) from a user's
    own ``ampguard.SafeGradScaler`` or ``partial(ampguard.SafeGradScaler, ...)``
    (kept as they are).
    """


class _LegacyGradScaler(GradScaler):
    """A SafeGradScaler with the legacy signature: init_scale first, the device fixed by the subclass."""

    legacy_device: str

    def __init__(
        self,
        init_scale: float | None = None,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int | None = None,
        enabled: bool = True,
        **safe_options: Any,
    ) -> None:
        super().__init__(
            self.legacy_device, init_scale, growth_factor, backoff_factor, growth_interval, enabled, **safe_options
        )


class CudaGradScaler(_LegacyGradScaler):
    """``torch.cuda.amp.GradScaler`` under ampguard: ``SafeGradScaler("cuda")`` with the legacy signature."""

    legacy_device = "cuda"


class CpuGradScaler(_LegacyGradScaler):
    """``torch.cpu.amp.GradScaler`` under ampguard: ``SafeGradScaler("cpu")`` with the legacy signature."""

    legacy_device = "cpu"


for _cls in (CudaGradScaler, CpuGradScaler):
    _cls.__name__ = "GradScaler"  # as torch's legacy classes are named; pickle uses the __qualname__
# What scripts print as type(scaler).__name__: ampguard's scaler is in use. Pickle uses the __qualname__.
GradScaler.__name__ = "SafeGradScaler"


class GradScalerPatch(Patch):
    name = "grad_scaler"
    summary = "every GradScaler is a SafeGradScaler: init_scale 1024, growth every 100 steps, skip accounting"
    requires_torch = ">=2.3"
    requires_privates = torch_privates.GRAD_SCALER

    def apply(self, config: Config) -> None:
        original = torch.amp.grad_scaler.GradScaler
        if not isinstance(original, type) or issubclass(original, SafeGradScaler):
            raise PatchUnavailable("torch.amp.grad_scaler.GradScaler is not torch's class")
        self.bindings.rebind_names_of(original, GradScaler)
        self.bindings.rebind_names_of(torch.cuda.amp.GradScaler, CudaGradScaler)
        cpu_legacy = getattr(torch.cpu.amp, "GradScaler", None)
        if cpu_legacy is not None:
            self.bindings.rebind_names_of(cpu_legacy, CpuGradScaler)
        # torch's warnings in GradScaler's methods name their caller: SafeGradScaler's, not the user's line.
        attribute_past_ampguard(self.bindings, torch.amp.grad_scaler)
        from ampguard.registry import when_imported  # (the registry imports the patches)

        when_imported(self, SHARDED_MODULE, _patch_sharded)

    def patch_sharded_module(self, module: Any) -> None:
        """Give FSDP's ShardedGradScaler SafeGradScaler's safety (its module was just imported)."""
        from ampguard.bindings import rebind_queued

        sharded = module.ShardedGradScaler
        if is_safe_sharded(sharded):
            return  # patched already (the hook of an import that raced with install, which patched it first)
        stock = TorchGradScaler
        if sharded.__bases__ == (GradScaler,):
            # Imported after install, it subclassed SafeGradScaler through the
            # rebound name; give it torch's base back so that uninstall leaves it stock.
            sharded.__bases__ = (stock,)
            module.GradScaler = stock
        self.bindings.rebind_names_of(sharded, safe_sharded_scaler_class(sharded))
        if getattr(module, "GradScaler", None) is stock:
            self.bindings.rebind_names_of(stock, GradScaler)
        rebind_queued([self.bindings])


def _patch_sharded(patch: GradScalerPatch, module: Any) -> None:
    try:
        patch.patch_sharded_module(module)
    except Exception as error:  # never the cause of a crash
        from ampguard.log import logger

        logger.warning("ampguard could not patch FSDP's ShardedGradScaler (%r); it stays torch's.", error)
