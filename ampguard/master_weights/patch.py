"""Patch ``master_weights``: optimizers step float32 master copies of half-precision parameters.

Wires :mod:`ampguard.master_weights` into torch:

* a global optimizer step pre-hook and post-hook
  (``torch.optim.optimizer.register_optimizer_step_pre_hook`` / ``..._post_hook``),
  which fire for every ``torch.optim.Optimizer``; for an optimizer without
  trainable half-precision parameters they cost a dict lookup and a tuple of
  its param-group list ids per step, and change nothing; for one with masters
  the global pre-hook keeps the optimizer's own swap pre-hook last (the
  user's pre-hooks see their own parameters);
* each optimizer class's hooked ``step`` (and ``Optimizer.profile_hook_step``,
  which hooks the classes torch meets later) wrapped so that a step that
  raises puts the model's parameters back into ``param_groups``;
* ``torch.optim.Optimizer.state_dict`` / ``load_state_dict`` / ``zero_grad`` /
  ``__getstate__`` wrapped on the base class, so that checkpoints and copies
  carry the masters and their float32 state, and ``zero_grad`` frees the
  masters' gradients;
* ``torch.nn.Module.load_state_dict`` wrapped so that a model loaded in the
  middle of training refreshes the masters of its parameters.

``AMPGUARD_MASTER_WEIGHTS`` picks the dtypes: ``fp16`` (default), ``all``
(float16 and bfloat16) or ``off`` (the patch does not apply).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

import ampguard.master_weights.checkpoints as checkpoints
import ampguard.master_weights.gradient_copies as gradient_copies
import ampguard.master_weights.handles as handles
import ampguard.master_weights.step as step
import ampguard.scaler.listeners as listeners
import ampguard.torch_privates as torch_privates
from ampguard.config import Config
from ampguard.errors import PatchUnavailable
from ampguard.master_weights.records import MasterWeights, record_of
from ampguard.patch import Patch

DTYPES = {"fp16": (torch.float16,), "all": (torch.float16, torch.bfloat16)}


class MasterWeightsPatch(Patch):
    name = "master_weights"
    summary = "optimizers step float32 master copies of trainable float16 parameters (bf16 too with =all)"
    requires_torch = ">=2.3"
    requires_privates = torch_privates.MASTER_WEIGHTS

    def __init__(self) -> None:
        super().__init__()
        self._handles: list[Any] = []
        # This application's masters (a new one each apply); the hooks and wrappers read it at each call.
        self.masters: MasterWeights | None = None

    def apply(self, config: Config) -> None:
        mode = getattr(config, "master_weights", "fp16")
        if mode == "off":
            raise PatchUnavailable("AMPGUARD_MASTER_WEIGHTS=off")
        from torch.optim import optimizer as optimizer_module

        pre = optimizer_module.register_optimizer_step_pre_hook
        post = optimizer_module.register_optimizer_step_post_hook
        base = torch.optim.Optimizer
        masters = MasterWeights(DTYPES[mode])
        for name, wrap in (
            ("state_dict", checkpoints.wrap_state_dict),
            ("load_state_dict", checkpoints.wrap_load_state_dict),
            ("zero_grad", checkpoints.wrap_zero_grad),
            ("__getstate__", checkpoints.wrap_getstate),
        ):
            wrapper = wrap(vars(base)[name], self)
            self.bindings.set_attribute(base, name, wrapper)
            masters.wrappers[name] = wrapper  # an optimizer class defining its own is not reached by them
        module_load = vars(torch.nn.Module)["load_state_dict"]
        self.bindings.set_attribute(
            torch.nn.Module, "load_state_dict", checkpoints.wrap_module_load_state_dict(module_load, self)
        )
        hook_step = vars(base)["profile_hook_step"].__func__
        self.bindings.set_attribute(
            base, "profile_hook_step", staticmethod(step.wrap_profile_hook_step(hook_step, self))
        )
        for cls in step.hooked_classes():
            self.bindings.set_attribute(cls, "step", step.put_back_on_error(vars(cls)["step"], self))
        self._handles = [pre(functools.partial(step.before_step, self)), post(functools.partial(step.after_step, self))]
        self.masters = masters
        # The scaler's unscale_ and the clip ask the bus which tensors hold the gradients (the masters' float32 ones).
        listeners.hold_gradients(
            listeners.GradientHolders(
                functools.partial(step.gradients, self), functools.partial(gradient_copies.gradient_pairs, masters)
            )
        )

    def revert(self) -> None:
        listeners.hold_gradients(None)
        masters, self.masters = self.masters, None
        if masters is not None:
            masters.retire_all()
        for handle in self._handles:
            handles.remove_hook(masters, handle)
        self._handles = []
        super().revert()
        step.unwrap_steps()


def applied_masters() -> MasterWeights | None:
    """The master weights of the applied master_weights patch (found through the registry); None when it is not
    applied."""
    from ampguard.registry import applied_patch  # (the registry imports the patches)

    patch = applied_patch(MasterWeightsPatch.name)
    return patch.masters if isinstance(patch, MasterWeightsPatch) else None


def masters_of(optimizer: Any) -> list[tuple[Tensor, Tensor]]:
    """``(parameter, master)`` pairs of ``optimizer`` (empty when it has none, or master weights are not applied)."""
    masters = applied_masters()
    record = record_of(masters, optimizer, create=False) if masters is not None else None
    return list(zip(record.params, record.masters)) if record is not None else []
