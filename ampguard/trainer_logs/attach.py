"""ampguard's numbers in the trainer's own records (patch ``trainer_logs``; docs/trainer-logs.md).

One module per trainer library, named in :data:`INTEGRATIONS` by the module
whose import means that trainer is in the process. ampguard never imports a
trainer library itself: a post-import hook (wrapt's, as for FSDP's scaler
module) attaches an integration when its module is imported, and at once when
it already is. Each integration module has ``attach(module, bindings)``, making
its changes through the patch's :class:`~ampguard.bindings.Bindings` (undone at
uninstall), and ``detach()`` for the rest.

Nothing here may stop a run: an integration that does not fit the installed
library version raises :class:`~ampguard.errors.PatchUnavailable` and is left
off with one INFO line; any other failure is contained
(:func:`ampguard.containment.report`).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

import ampguard.containment as containment
import ampguard.deepspeed_fp16.tracking as deepspeed_tracking
from ampguard.bindings import Bindings
from ampguard.errors import PatchUnavailable
from ampguard.log import logger
from ampguard.stats.counters import ScalerStats

if TYPE_CHECKING:
    from ampguard.scaler.safe import SafeGradScaler

# The module whose import means a trainer is there -> ampguard's integration for it.
INTEGRATIONS: dict[str, str] = {
    "trainer.trainer": "ampguard.trainer_logs.coqui",  # coqui-tts-trainer (and coqui's older `trainer`)
    "transformers.trainer": "ampguard.trainer_logs.hf",
    "accelerate.optimizer": "ampguard.trainer_logs.accelerate",  # its skip flag (not a log)
    "lightning.pytorch.trainer.trainer": "ampguard.trainer_logs.lightning",
    "pytorch_lightning.trainer.trainer": "ampguard.trainer_logs.lightning",
}


class Attachments(Protocol):
    """What the trainer_logs patch holds: its bindings, and the integration attached to each trainer module."""

    bindings: Bindings
    attached: dict[str, ModuleType]


def _applied() -> Attachments | None:
    from ampguard.registry import applied_patch  # (the registry imports the patches)

    patch = applied_patch("trainer_logs")
    return patch if isinstance(getattr(patch, "attached", None), dict) else None  # type: ignore[return-value]


def active() -> bool:
    """True while the patch is applied (a callback left in a trainer built earlier does nothing otherwise)."""
    return _applied() is not None


def activate(patch: Attachments) -> None:
    """Attach every integration whose trainer module is imported, now or later."""
    from ampguard.registry import when_imported  # (the registry imports the patches)

    for module_name in INTEGRATIONS:
        when_imported(patch, module_name, _attach)  # type: ignore[arg-type]  # (the patch object: a Patch)


def deactivate(patch: Attachments) -> None:
    """Detach every integration (the patch's revert then undoes their bindings)."""
    for integration in patch.attached.values():
        try:
            integration.detach()
        except Exception as error:  # never the cause of a crash
            containment.report("trainer_logs detach", error)
    patch.attached.clear()


def attached() -> list[str]:
    """The trainer modules an integration is attached to now."""
    patch = _applied()
    return sorted(patch.attached) if patch is not None else []


def _attach(patch: Attachments, module: ModuleType) -> None:
    name = module.__name__
    if name in patch.attached:
        return
    try:
        integration = importlib.import_module(INTEGRATIONS[name])
        integration.attach(module, patch.bindings)
    except PatchUnavailable as reason:
        logger.info("ampguard's stats do not reach %s's logs: %s", name, reason)
        return
    except Exception as error:  # a hook inside somebody's import: never let it fail
        containment.report(f"trainer_logs hook for {name}", error)
        return
    patch.attached[name] = integration


class MetricFields:
    """The ``ampguard/...`` numbers a trainer's metrics get, with the skipped steps since the previous call.

    Plain floats only: reporting integrations (TensorBoard, W&B, CSV) drop anything else.
    """

    def __init__(self) -> None:
        self._skipped_before = 0

    def __call__(self, stats: ScalerStats) -> dict[str, float]:
        skipped_now = max(stats.skipped - self._skipped_before, 0)
        self._skipped_before = stats.skipped
        return {
            "ampguard/loss_scale": float(stats.scale),
            "ampguard/skipped": float(skipped_now),
            "ampguard/skipped_total": float(stats.skipped),
            "ampguard/nonfinite_loss": float(stats.nonfinite_loss),
            "ampguard/fp32_islands": float(len(stats.fp32_islands)),
        }


def deepspeed_stats(optimizer: object) -> ScalerStats | None:
    """ampguard's counts of a DeepSpeed fp16 loss scale (docs/deepspeed.md), for ``optimizer``: DeepSpeed's own
    optimizer or accelerate's wrapper around it (the HF Trainer's); None when it has none."""
    for candidate in (getattr(optimizer, "optimizer", None), optimizer):
        counts = deepspeed_tracking.of(candidate) if candidate is not None else None
        if counts is not None:
            return counts.stats
    return None


def safe_scaler(candidate: object) -> SafeGradScaler | None:
    """``candidate`` when it is an enabled SafeGradScaler (the one a trainer holds), else None."""
    from ampguard.scaler import SafeGradScaler  # (late: the scaler package imports much of ampguard)

    if isinstance(candidate, SafeGradScaler) and candidate.is_enabled():
        return candidate
    return None
