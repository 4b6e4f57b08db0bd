"""HF Trainer: ampguard's numbers in ``trainer.state.log_history``, and so in every reporting integration.

:class:`AmpguardCallback` joins ``transformers.trainer.DEFAULT_CALLBACKS`` (a
new list bound in its place, the old one back at uninstall), which
``Trainer.__init__`` reads: every Trainer built while ampguard is installed has
it, right after ``DefaultFlowCallback`` and before the reporting callbacks
(TensorBoard, W&B, MLflow, ...). At each of the Trainer's own logging steps
(``on_log``, every ``logging_steps``) it adds ``ampguard/loss_scale``,
``ampguard/skipped`` (since the previous log), ``ampguard/skipped_total``,
``ampguard/nonfinite_loss`` and ``ampguard/fp32_islands`` to the logs dict the
later callbacks receive, and to the ``log_history`` entry ``Trainer.log`` has
just appended (a copy made before the callbacks run). Evaluation and prediction
logs are left as they are. ``trainer.remove_callback(callback_class())`` turns
it off for one Trainer.

Under DeepSpeed fp16 (``--deepspeed``, no GradScaler) the numbers are those of
DeepSpeed's loss scale as ampguard counts it (docs/deepspeed.md).

Cost: nothing on the other steps. At a logging step it reads the scaler's
``stats``, which after fused-optimizer steps reads the device once; the
Trainer reads its loss from the device at the same steps.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import ampguard.containment as containment
import ampguard.trainer_logs.attach as integrations
from ampguard.bindings import Bindings
from ampguard.errors import PatchUnavailable

_callback_class: type | None = None


def callback_class() -> type:
    """``AmpguardCallback``, a ``transformers.TrainerCallback`` (made once transformers is imported)."""
    global _callback_class
    if _callback_class is None:
        from transformers.trainer_callback import TrainerCallback

        class AmpguardCallback(TrainerCallback):
            """Adds ampguard's ``ampguard/...`` numbers to the Trainer's training logs (ampguard.trainer_logs.hf)."""

            def __init__(self) -> None:
                self._fields = integrations.MetricFields()

            def on_log(
                self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
            ) -> None:
                if logs is not None and integrations.active():
                    try:
                        _merge(self._fields, state, logs, kwargs.get("optimizer"))
                    except Exception as error:  # never the reason a run dies
                        containment.report("HF Trainer callback", error)

        _callback_class = AmpguardCallback
    return _callback_class


def _merge(fields: integrations.MetricFields, state: Any, logs: dict[str, Any], optimizer: Any) -> None:
    if any(key.startswith(("eval_", "test_")) for key in logs):
        return
    scaler = integrations.safe_scaler(getattr(optimizer, "scaler", None))  # accelerate's AcceleratedOptimizer
    stats = scaler.stats if scaler is not None else integrations.deepspeed_stats(optimizer)  # or DeepSpeed's fp16
    if stats is None:
        return
    numbers = fields(stats)
    entry = state.log_history[-1] if state.log_history else None
    # Trainer.log appended {**logs, "step": global_step} just before the callbacks: that entry gets them too.
    if isinstance(entry, dict) and entry.get("step") == state.global_step and set(entry) - {"step"} == set(logs):
        entry.update(numbers)
    logs.update(numbers)


def attach(module: ModuleType, bindings: Bindings) -> None:
    defaults = getattr(module, "DEFAULT_CALLBACKS", None)
    if not isinstance(defaults, list):
        raise PatchUnavailable(f"{module.__name__}.DEFAULT_CALLBACKS is not a list")
    callback = callback_class()
    if callback not in defaults:
        bindings.set_attribute(module, "DEFAULT_CALLBACKS", [*defaults, callback])


def detach() -> None:
    """Nothing to do: the bindings give the list back; callbacks in Trainers built earlier go quiet."""
