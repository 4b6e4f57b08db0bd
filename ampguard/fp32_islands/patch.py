"""Patch ``fp32_islands``: a module that overflows float16 in the forward pass is found and run in float32.

It changes nothing in torch until a loss is inf/NaN: applying it only hands
the configuration to :mod:`ampguard.fp32_islands.healing`, which SafeGradScaler calls after
each update. From the first forward overflow on, the probe
(:mod:`ampguard.fp32_islands.probe`) watches the following forward passes, the module it
names becomes an fp32 island (:mod:`ampguard.fp32_islands.islands`), and buffers the
overflowed forward pass updated are put back (:mod:`ampguard.fp32_islands.buffers`).
Reverting removes every hook the probe, the islands and the buffer guard hold.
docs/islands.md describes it.
"""

from __future__ import annotations

import ampguard.fp32_islands.healing as healing
import ampguard.torch_privates as torch_privates
from ampguard.config import Config
from ampguard.patch import Patch


class Fp32IslandsPatch(Patch):
    name = "fp32_islands"
    summary = (
        "a forward overflow keeps the loss scale, restores BatchNorm statistics, and the module that "
        "overflowed is found and run in fp32"
    )
    requires_torch = ">=2.3"
    requires_privates = torch_privates.FP32_ISLANDS

    def apply(self, config: Config) -> None:
        healing.activate(config)

    def revert(self) -> None:
        healing.deactivate()
        super().revert()
