"""Patch ``clip_grad``: ``clip_grad_norm_`` always acts on unscaled gradients, with float32 norms.

Wraps, with wrapt (signature, docstring and return value kept),
``torch.nn.utils.clip_grad_norm_`` and ``torch.nn.utils.clip_grad.clip_grad_norm_``
(two names of one function), the deprecated ``torch.nn.utils.clip_grad_norm``,
``clip_grad_value_``, torch >= 2.6's ``get_total_norm`` and ``clip_grads_with_norm_``
(``_get_total_norm`` / ``_clip_grads_with_norm_`` in ``torch.nn.utils.clip_grad``,
which torch's own ``clip_grad_norm_`` calls), and every name bound to them before
ampguard was imported. The behaviour is :mod:`ampguard.clip_grad.norm`'s and
:mod:`ampguard.clip_grad.api`'s; docs/clipping.md describes it.

When the grad_scaler patch is applied (it is applied before this one), every
GradScaler is a SafeGradScaler, so "no SafeGradScaler scaled a loss" means "no
loss was scaled" and the no-scaler NaN guard is on. To keep that true for a
scaler of torch's own class that already existed (created before ``import
ampguard``), torch's ``GradScaler.scale`` is wrapped to notice one; the guard
then turns itself off.
"""

from __future__ import annotations

import torch
import wrapt

import ampguard.clip_grad.api as api
import ampguard.clip_grad.norm as norm
import ampguard.clip_grad.scalers as scalers
import ampguard.clip_grad.wrapping as wrapping
import ampguard.torch_privates as torch_privates
from ampguard.clip_grad.state import ClipState
from ampguard.config import Config
from ampguard.errors import PatchUnavailable
from ampguard.patch import Patch
from ampguard.patches.warning_attribution import attribute_past_ampguard
from ampguard.scaler import TorchGradScaler


def _grad_scaler_patch_applied() -> bool:
    """Whether every GradScaler is a SafeGradScaler: the grad_scaler patch applied (it applies before this one)."""
    from ampguard.registry import applied_patch  # (the registry imports the patches)

    return applied_patch("grad_scaler") is not None


class ClipGradPatch(Patch):
    name = "clip_grad"
    summary = (
        "clip_grad_norm_, clip_grad_value_, get_total_norm, clip_grads_with_norm_ act on unscaled gradients, "
        "float32 norms; "
        "an inf/NaN norm skips the step (no GradScaler: grads set to None)"
    )
    requires_torch = ">=2.3"
    requires_privates = torch_privates.CLIP_GRAD

    def __init__(self) -> None:
        super().__init__()
        # This application's state (a new one each apply); the wrappers read it at every call, so that a name
        # bound to one of them before an uninstall and install clips again, and after an uninstall is torch's.
        self.clip: ClipState | None = None

    def apply(self, config: Config) -> None:
        module = torch.nn.utils.clip_grad
        original = getattr(module, "clip_grad_norm_", None)
        if not callable(original):
            raise PatchUnavailable("torch.nn.utils.clip_grad.clip_grad_norm_ is missing")
        if isinstance(original, wrapt.FunctionWrapper):
            raise PatchUnavailable("torch.nn.utils.clip_grad.clip_grad_norm_ is already wrapped")
        self.bindings.rebind_names_of(
            original,
            wrapping.safe_function_wrapper(original, norm.clip_grad_norm_wrapper, self, idle=norm.idle),
        )
        originals = {}
        for name, wrapper, idle in api.WRAPPED:
            function = getattr(module, name, None)  # get_total_norm, clip_grads_with_norm_: torch >= 2.6
            if callable(function) and not isinstance(function, wrapt.FunctionWrapper):
                originals[name] = function
                self.bindings.rebind_names_of(
                    function, wrapping.safe_function_wrapper(function, wrapper, self, idle=idle)
                )
        total_norm, clip_with_norm = originals.get("_get_total_norm"), originals.get("_clip_grads_with_norm_")
        deprecated = getattr(module, "clip_grad_norm", None)
        deprecation = None
        if callable(deprecated) and not isinstance(deprecated, wrapt.FunctionWrapper):
            deprecation = wrapping.record_deprecation(deprecated)
            self.bindings.rebind_names_of(
                deprecated, wrapping.safe_function_wrapper(deprecated, norm.deprecated_clip_grad_norm_wrapper, self)
            )
        # torch's warnings in the clip (an empty generator of parameters) name the caller's line, not ampguard's.
        attribute_past_ampguard(self.bindings, module)
        guard = _grad_scaler_patch_applied()
        if guard:
            scale = vars(TorchGradScaler).get("scale")
            if scale is not None:
                self.bindings.set_attribute(TorchGradScaler, "scale", scalers.scale_wrapper(scale, self))
        self.clip = ClipState(
            original,
            guard=guard,
            deprecation=deprecation,
            stats_every=config.stats_every,
            halves=(total_norm, clip_with_norm) if total_norm and clip_with_norm else None,
        )

    def revert(self) -> None:
        self.clip = None
        super().revert()
