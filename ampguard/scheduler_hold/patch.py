"""Patch ``scheduler_hold``: an LR scheduler does not advance on an optimizer step the GradScaler skipped.

Wraps ``step`` of ``torch.optim.lr_scheduler.LRScheduler`` and of every
scheduler class in that module that defines its own (``SequentialLR``,
``ChainedScheduler``, ``ReduceLROnPlateau``, ``CosineAnnealingWarmRestarts``).
The behaviour is :mod:`ampguard.scheduler_hold.hold`'s; docs/schedulers.md
describes it. ``AMPGUARD_DISABLE=scheduler_hold`` keeps torch's schedulers.
"""

from __future__ import annotations

import torch

import ampguard.scaler.listeners as listeners
import ampguard.scheduler_hold.hold as scheduler_hold
from ampguard.config import Config
from ampguard.errors import PatchUnavailable
from ampguard.patch import Patch
from ampguard.patches.warning_attribution import attribute_past_ampguard


class SchedulerHoldPatch(Patch):
    name = "scheduler_hold"
    summary = (
        "an LR scheduler does not advance on an optimizer step the GradScaler skipped "
        "(and torch's 'lr_scheduler.step() before optimizer.step()' warning is not raised for it)"
    )
    requires_torch = ">=2.3"

    def __init__(self) -> None:
        super().__init__()
        self.listener = scheduler_hold.StepsListener()
        self.hold: scheduler_hold.Hold | None = None  # this application's (a new one each apply)

    def apply(self, config: Config) -> None:
        module = torch.optim.lr_scheduler
        base = getattr(module, "LRScheduler", None)
        if not isinstance(base, type) or not callable(vars(base).get("step")):
            raise PatchUnavailable("torch.optim.lr_scheduler.LRScheduler.step is missing")
        classes = [
            cls
            for cls in vars(module).values()
            if isinstance(cls, type) and issubclass(cls, base) and callable(vars(cls).get("step"))
        ]
        self.hold = scheduler_hold.Hold()
        for cls in classes:
            self.bindings.set_attribute(cls, "step", scheduler_hold.step_wrapper(vars(cls)["step"], self))
        # torch's warnings in step() (ordering, deprecated epoch) name its caller: the wrapper, not the user's line.
        attribute_past_ampguard(self.bindings, module)
        listeners.add(self.listener)

    def revert(self) -> None:
        listeners.remove(self.listener)
        self.hold = None
        super().revert()
