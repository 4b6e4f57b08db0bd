"""Patch ``fp32_islands``: a module that overflows float16 in the forward pass is found and run in float32.

It changes nothing in torch until a loss is inf/NaN: applying it only hands
the configuration to :mod:`ampguard.healing`, which SafeGradScaler calls after
each update. From the first forward overflow on, the probe
(:mod:`ampguard.probe`) watches the following forward passes, the module it
names becomes an fp32 island (:mod:`ampguard.islands`), and buffers the
overflowed forward pass updated are put back (:mod:`ampguard.buffers`).
Reverting removes every hook the probe, the islands and the buffer guard hold.
docs/islands.md describes it.
"""

from __future__ import annotations

import inspect

import torch
from torch.nn.modules import module as nn_module

from ampguard import healing
from ampguard.config import Config
from ampguard.errors import PatchUnavailable
from ampguard.patches.base import Patch


class Fp32IslandsPatch(Patch):
    name = "fp32_islands"
    summary = (
        "a forward overflow keeps the loss scale, restores BatchNorm statistics, and the module that "
        "overflowed is found and run in fp32"
    )
    requires_torch = ">=2.3"

    def apply(self, config: Config) -> None:
        if "always_call" not in inspect.signature(nn_module.register_module_forward_hook).parameters:
            raise PatchUnavailable("torch.nn.modules.module.register_module_forward_hook has no always_call")
        if not hasattr(torch, "_foreach_copy_"):
            raise PatchUnavailable("torch._foreach_copy_ is missing")
        healing.activate(config)

    def revert(self) -> None:
        healing.deactivate()
        super().revert()
