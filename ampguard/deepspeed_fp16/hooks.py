"""The replacements of DeepSpeed's loss-scale methods (deepspeed/runtime/fp16/loss_scaler.py and its callers).

Each is made by a function here around DeepSpeed's original and ampguard's
:class:`~ampguard.deepspeed_fp16.tracking.Policy`, and bound on DeepSpeed's
class by the patch (undone at uninstall):

- ``DeepSpeedFP16Config.dynamic_loss_scale_args`` / ``initial_dynamic_scale``: the safe start. Every fp16 path
  (the engine's FP16_Optimizer and FP16_UnfusedOptimizer, ZeRO stages 1-3 through ``CreateLossScaler``) takes its
  initial dynamic scale from these two; a config that sets ``initial_scale_power`` keeps it, and a static
  ``loss_scale`` never reads them.
- ``DynamicLossScaler.update_scale`` (ZeRO 1-3): DeepSpeed's hysteresis and growth as they are; a back-off never
  goes below the floor, and an overflow at the floor keeps the scale there instead of raising "Current loss scale
  already at minimum - cannot decrease scale anymore. Exiting run.".
- ``FP16_Optimizer._update_scale`` / ``FP16_UnfusedOptimizer._update_scale`` (ZeRO 0, the ``LossScaleConfig``
  path): DeepSpeed's update, then the floor and cap.

A forward overflow (a loss itself inf/NaN: :func:`ampguard.deepspeed_fp16.losses.forward_overflow`) is not the
scale's doing, as under a SafeGradScaler (:func:`ampguard.scaler.policy.forward_overflow`): DeepSpeed's update is
not run for it, so its scale, hysteresis and growth window stay as they were; the step is still skipped (DeepSpeed
skipped it before its update) and counted.

- ``DeepSpeedEngine.backward``: the loss kept, to tell a forward overflow from a gradient one
  (:mod:`ampguard.deepspeed_fp16.losses`).

Each counts the step it is told of and tells the step listeners (fp32 islands) whether it was a forward overflow. ampguard's own work in them is contained
(:mod:`ampguard.containment`): where it fails, DeepSpeed's behaviour is used for that call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ampguard.containment as containment
import ampguard.deepspeed_fp16.losses as losses
import ampguard.deepspeed_fp16.tracking as tracking
import ampguard.scaler.listeners as listeners
from ampguard.deepspeed_fp16.tracking import Policy
from ampguard.errors import ScaleCollapseError


def start_power(policy: Policy) -> int:
    """The power of two DeepSpeed's config takes (``initial_scale_power``): ampguard's start, rounded down."""
    return max(int(policy.start).bit_length() - 1, 0)


def dynamic_loss_scale_args(original: Callable[[Any], dict[str, Any]], policy: Policy) -> Callable[[Any], Any]:
    def dynamic_loss_scale_args(self: Any) -> dict[str, Any]:
        arguments = original(self)
        try:
            if "initial_scale_power" not in self.model_fields_set and "init_scale" in arguments:
                arguments = {**arguments, "init_scale": 2 ** start_power(policy)}
        except Exception as error:  # never the reason a run dies: DeepSpeed's arguments as they were
            containment.report("deepspeed_fp16 start", error)
        return arguments

    return dynamic_loss_scale_args


def initial_dynamic_scale(original: Callable[[Any], Any], policy: Policy) -> Callable[[Any], Any]:
    def initial_dynamic_scale(self: Any) -> Any:
        try:
            if "initial_scale_power" not in self.model_fields_set:
                return 2 ** start_power(policy)
        except Exception as error:
            containment.report("deepspeed_fp16 start", error)
        return original(self)

    return initial_dynamic_scale


def update_scale(original: Callable[[Any, bool], None], policy: Policy) -> Callable[[Any, bool], None]:
    """``DynamicLossScaler.update_scale`` (ZeRO 1-3)."""

    def update_scale(self: Any, overflow: bool) -> None:
        try:
            floor = max(policy.floor, float(self.min_scale))
            before = float(self.cur_scale)
            forward = losses.forward_overflow(bool(overflow), self)  # a loss inf/NaN: one read, at an overflow only
            backing_off = bool(overflow) and (self.delayed_shift == 1 or self.cur_hysteresis == 1)
            at_floor = backing_off and before <= floor and not forward
        except Exception as error:
            containment.report("deepspeed_fp16 update_scale", error)
            return original(self, overflow)
        if forward:  # not the scale's doing: scale, hysteresis and growth window as they were
            pass
        elif at_floor:  # what DeepSpeed does at its minimum when told not to raise: the scale stays
            self.last_overflow_iter = self.cur_iter
            self.cur_iter += 1
        else:
            original(self, overflow)
        _after(self, policy, before, bool(overflow), floor, at_floor, forward)

    return update_scale


def static_update_scale(original: Callable[[Any, bool], None], policy: Policy) -> Callable[[Any, bool], None]:
    """``LossScalerBase.update_scale``: a static ``loss_scale`` at ZeRO 1-3, which DeepSpeed never changes (the
    workaround its fp16 threads recommend): its skips counted and its forward overflows told to the fp32 islands,
    as for a dynamic scale; the scale left as it is. A bf16 engine's scaler (a static 1) is left alone."""

    def update_scale(self: Any, overflow: bool) -> None:
        try:
            fp16 = losses.steps_fp16(self)
            before = float(self.cur_scale)
            forward = losses.forward_overflow(bool(overflow), self) if fp16 else False  # one read, at an overflow
        except Exception as error:
            containment.report("deepspeed_fp16 static update_scale", error)
            return original(self, overflow)
        original(self, overflow)
        if fp16:
            _after(self, policy, before, bool(overflow), 0.0, False, forward)

    return update_scale


def optimizer_update_scale(original: Callable[[Any, bool], None], policy: Policy) -> Callable[[Any, bool], None]:
    """``FP16_Optimizer._update_scale`` / ``FP16_UnfusedOptimizer._update_scale`` (ZeRO 0)."""

    def _update_scale(self: Any, skip: bool) -> None:
        try:
            config = self.loss_scale_config
            before = float(config.cur_scale)
            scaling = bool(config.use_grad_scaling)  # bf16 / fp32: no loss scale to look after
            forward = scaling and losses.forward_overflow(bool(skip), self)  # one read, at an overflow only
        except Exception as error:
            containment.report("deepspeed_fp16 _update_scale", error)
            return original(self, skip)
        if not (forward and config.dynamic_loss_scale):  # a forward overflow: scale and growth window as they were
            original(self, skip)
        try:
            if not scaling:
                return
            floor = max(policy.floor, float(config.min_loss_scale or 0.0)) if config.dynamic_loss_scale else 0.0
            at_floor = bool(skip) and bool(config.dynamic_loss_scale) and before <= floor and not forward
        except Exception as error:
            containment.report("deepspeed_fp16 _update_scale", error)
            return
        _after(config, policy, before, bool(skip), floor, at_floor, forward, holder=self)

    return _update_scale


def _after(
    scale_owner: Any,
    policy: Policy,
    before: float,
    overflow: bool,
    floor: float,
    at_floor: bool,
    forward: bool,
    holder: Any = None,
) -> None:
    """The floor and cap on the scale DeepSpeed just set (``scale_owner.cur_scale``), and the step counted.

    ``forward``: the step's overflow was a forward one (told to the step listeners: the fp32 islands).
    ``floor`` is 0 for a static scale, which is left as it is. The cap stops growth only: a larger scale the
    user's config started from is DeepSpeed's to lower.
    """
    try:
        scale = float(scale_owner.cur_scale)
        if floor:
            bounded = max(scale, floor)
            if bounded > policy.cap and bounded > before:
                bounded = max(before, policy.cap)
            if bounded != scale:
                scale_owner.cur_scale = bounded
                scale = bounded
        counts = tracking.tracker(scale_owner if holder is None else holder, before)
        counts.record(policy, overflow, scale, at_floor, floor, forward=forward)
    except ScaleCollapseError:
        raise  # AMPGUARD_ON_STALL=raise: asked for
    except Exception as error:
        containment.report("deepspeed_fp16 counting", error)
        return
    listeners.notify_foreign_step(counts, forward)  # to the fp32 islands
