"""Patch ``underflow``: sampled steps measure the float16 gradients the loss scale loses, and the scale follows.

Registers :class:`~ampguard.underflow.listener.UnderflowListener` with every
SafeGradScaler (:mod:`ampguard.scaler.listeners`). Of torch, only ``torch.export.export``
is wrapped: it runs with the sampler's global module hooks lifted (armed from one
update to the next forward, they made torch 2.14's strict export refuse the model;
the fp32_islands patch lifts its own and the sampler's the same way).
``AMPGUARD_UNDERFLOW=adapt`` (default) grows the scale while the measured
underflow is material and the gradients have room, ``report`` only measures
and reports, ``off`` measures nothing. docs/underflow.md describes it.
"""

from __future__ import annotations

import torch

import ampguard.scaler.listeners as listeners
import ampguard.torch_privates as torch_privates
from ampguard.config import Config
from ampguard.module_hooks import without_global_hooks
from ampguard.patch import Patch
from ampguard.underflow.listener import UnderflowListener


class UnderflowPatch(Patch):
    name = "underflow"
    summary = (
        "sampled steps measure how much of the float16 gradient traffic the loss scale loses to underflow "
        "(scaler.stats underflow_*); the scale grows while that is material and the gradients have room"
    )
    requires_torch = ">=2.3"
    requires_privates = torch_privates.MODULE_HOOKS

    def __init__(self) -> None:
        super().__init__()
        self.listener: UnderflowListener | None = None

    def apply(self, config: Config) -> None:
        if config.underflow == "off":
            return
        self.listener = UnderflowListener(config.underflow, config.underflow_every)
        listeners.add(self.listener, subscribed=())  # it subscribes while it samples
        export = getattr(torch, "export", None)
        if export is not None and hasattr(export, "export"):
            self.bindings.set_attribute(export, "export", without_global_hooks(export.export))

    def revert(self) -> None:
        if self.listener is not None:
            listeners.remove(self.listener)
            self.listener.stop()
            self.listener = None
        super().revert()
