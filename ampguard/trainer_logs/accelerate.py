"""accelerate: ``optimizer_step_was_skipped`` also true on a step ampguard knows its scaler skipped.

accelerate (and the HF Trainer, the coqui trainer and accelerate's prepared
scheduler, which read it) detects a skip by swapping ``optimizer.step`` during
``scaler.step`` and reporting one when it was not called. That sees every skip
of a non-fused optimizer, forward overflows included. A fused optimizer
(``adamw_torch_fused``, the HF Trainer's default) is always called and skips
on the device, so accelerate never reports its skips, under torch's scaler as
under ampguard's. ``AcceleratedOptimizer.step_was_skipped`` is wrapped to also
be true when the SafeGradScaler's verdict for that optimizer's last step is
already on the host (:meth:`SafeGradScaler.knows_skipped <ampguard.scaler.accounting.HostBooks.knows_skipped>`): after a
fused step that is while ampguard reads each step anyway (the forward-overflow
probe watching) or once it has read its counters since (a stats line,
``scaler.stats``). It never reads the device itself.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import ampguard.containment as containment
import ampguard.trainer_logs.attach as integrations
from ampguard.bindings import Bindings
from ampguard.errors import PatchUnavailable


def attach(module: ModuleType, bindings: Bindings) -> None:
    accelerated = getattr(module, "AcceleratedOptimizer", None)
    accelerate_s = vars(accelerated).get("step_was_skipped") if isinstance(accelerated, type) else None
    if not isinstance(accelerate_s, property) or accelerate_s.fget is None:
        raise PatchUnavailable(f"{module.__name__}.AcceleratedOptimizer.step_was_skipped is not a property")
    bindings.set_attribute(accelerated, "step_was_skipped", property(_step_was_skipped(accelerate_s.fget)))


def _step_was_skipped(accelerate_s: Any) -> Any:
    def step_was_skipped(self: Any) -> bool:
        """Whether or not the optimizer step was skipped (accelerate's answer, or ampguard's scaler's)."""
        if accelerate_s(self):
            return True
        try:
            scaler = integrations.safe_scaler(getattr(self, "scaler", None))
            return scaler is not None and scaler.knows_skipped(self.optimizer)
        except Exception as error:  # never the reason a run dies: accelerate's answer
            containment.report("accelerate's step_was_skipped", error)
            return False

    return step_was_skipped


def detach() -> None:
    """Nothing to do: the bindings give accelerate its property back."""
