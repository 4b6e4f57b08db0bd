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

from typing import Any

import torch

import ampguard.master_weights.checkpoints as checkpoints
import ampguard.master_weights.step as step
import ampguard.torch_privates as torch_privates
from ampguard.config import Config
from ampguard.errors import PatchUnavailable
from ampguard.master_weights import activate, deactivate
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

    def apply(self, config: Config) -> None:
        mode = getattr(config, "master_weights", "fp16")
        if mode == "off":
            raise PatchUnavailable("AMPGUARD_MASTER_WEIGHTS=off")
        from torch.optim import optimizer as optimizer_module

        pre = optimizer_module.register_optimizer_step_pre_hook
        post = optimizer_module.register_optimizer_step_post_hook
        base = torch.optim.Optimizer
        for name, wrap in (
            ("state_dict", checkpoints.wrap_state_dict),
            ("load_state_dict", checkpoints.wrap_load_state_dict),
            ("zero_grad", checkpoints.wrap_zero_grad),
            ("__getstate__", checkpoints.wrap_getstate),
        ):
            self.bindings.set_attribute(base, name, wrap(vars(base)[name]))
        module_load = vars(torch.nn.Module)["load_state_dict"]
        self.bindings.set_attribute(
            torch.nn.Module, "load_state_dict", checkpoints.wrap_module_load_state_dict(module_load)
        )
        hook_step = vars(base)["profile_hook_step"].__func__
        self.bindings.set_attribute(base, "profile_hook_step", staticmethod(step.wrap_profile_hook_step(hook_step)))
        for cls in step.hooked_classes():
            self.bindings.set_attribute(cls, "step", step.put_back_on_error(vars(cls)["step"]))
        self._handles = [pre(step.before_step), post(step.after_step)]
        activate(DTYPES[mode])

    def revert(self) -> None:
        deactivate()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        super().revert()
        step.unwrap_steps()
