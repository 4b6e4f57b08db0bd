"""Lightning: ampguard's numbers through ``LightningModule.log``, so in every logger the Trainer has.

``Trainer.__init__`` (of ``lightning.pytorch`` and of ``pytorch_lightning``) is
wrapped to append :class:`AmpguardCallback` to the Trainer's callbacks. On a
training batch where Lightning itself updates its loggers (every
``log_every_n_steps``, the same test Lightning makes right after this hook) and
the precision plugin holds a SafeGradScaler, the callback logs
``ampguard/loss_scale``, ``ampguard/skipped`` (since its previous log),
``ampguard/skipped_total``, ``ampguard/nonfinite_loss`` and
``ampguard/fp32_islands`` with ``pl_module.log_dict(on_step=True,
on_epoch=False)``: they reach ``trainer.logged_metrics`` and the loggers
(CSV, TensorBoard, W&B, ...) in the same row as the user's own step metrics.

Cost: nothing on the other steps; at a logging step, the scaler's ``stats``
(a device read after fused-optimizer steps; Lightning moves its own logged
values to the host at the same steps).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import ampguard.containment as containment
import ampguard.trainer_logs.attach as integrations
from ampguard.bindings import Bindings
from ampguard.errors import PatchUnavailable

_callback_classes: dict[str, type] = {}  # package ("lightning.pytorch", "pytorch_lightning") -> its callback class


def callback_class(package: str) -> type:
    """``AmpguardCallback`` for ``package``'s Trainer (a subclass of that package's ``Callback``)."""
    if package not in _callback_classes:
        base = importlib.import_module(f"{package}.callbacks").Callback

        class AmpguardCallback(base):  # type: ignore[misc, valid-type]
            """Logs ampguard's ``ampguard/...`` numbers at Lightning's logging steps (ampguard.trainer_logs.lightning)."""

            def __init__(self) -> None:
                self._fields = integrations.MetricFields()

            def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
                if integrations.active():
                    try:
                        _log(self._fields, trainer, pl_module)
                    except Exception as error:  # never the reason a run dies
                        containment.report("Lightning callback", error)

        _callback_classes[package] = AmpguardCallback
    return _callback_classes[package]


def _log(fields: integrations.MetricFields, trainer: Any, pl_module: Any) -> None:
    connector = getattr(trainer, "_logger_connector", None)
    if connector is None or not connector.should_update_logs:
        return
    scaler = integrations.safe_scaler(getattr(trainer.precision_plugin, "scaler", None))
    if scaler is not None:
        pl_module.log_dict(fields(scaler.stats), on_step=True, on_epoch=False)


def _adding_the_callback(init: Callable[..., None], package: str) -> Callable[..., None]:
    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if integrations.active():
            try:
                self.callbacks.append(callback_class(package)())
            except Exception as error:  # never the reason a run dies
                containment.report("Lightning callback", error)

    return __init__


def attach(module: ModuleType, bindings: Bindings) -> None:
    trainer = getattr(module, "Trainer", None)
    if not isinstance(trainer, type) or "__init__" not in vars(trainer):
        raise PatchUnavailable(f"{module.__name__} has no Trainer class of its own")
    package = module.__name__.removesuffix(".trainer.trainer")
    bindings.set_attribute(trainer, "__init__", _adding_the_callback(vars(trainer)["__init__"], package))


def detach() -> None:
    """Nothing to do: the bindings give ``__init__`` back; callbacks in Trainers built earlier go quiet."""
