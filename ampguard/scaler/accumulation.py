"""Gradient accumulation after ``unscale_()``: a second ``unscale_`` that is safe, and when it is not a no-op.

torch refuses a second ``scaler.unscale_(optimizer)`` before ``update()``
("unscale_() has already been called"). Libraries and users call it twice all
the same: Lightning's manual optimisation unscales again in ``opt.step()``,
a user and accelerate both unscale before clipping. When nothing changed the
gradients in between, the second call must be a no-op, and SafeGradScaler
makes it one.

It must not be a no-op when more gradients arrived in between: gradient
accumulation with ``unscale_`` (or accelerate's ``clip_grad_norm_``) on every
micro-step adds *scaled* gradients to already unscaled ones. Every such
micro-step starts with ``scaler.scale(loss)``, so that is where
:func:`rescale_unscaled_gradients` runs: the gradients of every optimizer
unscaled so far in this iteration are multiplied by the scale again and the
optimizer goes back to torch's READY stage. The next ``unscale_`` (explicit,
or inside ``step()``) then divides the whole sum, and checks all of it for
inf/NaN, exactly as if ``unscale_`` had been called once at the end. An
inf/NaN from an earlier micro-step stays in the gradients, so it is still found.

With the default power-of-two scale, multiplying back is exact: the result is
bit-identical to the single-unscale recipe. It costs one foreach multiply per
optimizer, and only in this pattern: a healthy iteration that unscales once
never gets here.

The one case it cannot see: a loss passed to ``scale()`` *before* the first
``unscale_`` and back-propagated after it. Then the second ``unscale_`` is a
no-op as before (torch would raise); no trainer does this.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.amp import grad_scaler

import ampguard.scaler.listeners as listeners
from ampguard.scaler.parts import ScalerParts


class Accumulation(ScalerParts):
    """``scale()`` again after ``unscale_()`` in one iteration: the gradients multiplied back first."""

    def _rescale_unscaled_gradients(self) -> None:
        """Multiply the gradients of every optimizer unscaled (and not stepped) this iteration back by the scale."""
        scale = self._scale
        if scale is None:
            return
        kept: list[Any] = []
        for optimizer in self._iteration.unscaled_optimizers:
            state = self._per_optimizer_states.get(id(optimizer))  # .get: never create an entry
            if state is None or state["stage"] is not grad_scaler.OptState.UNSCALED:
                kept.append(optimizer)
                continue
            _multiply_gradients(optimizer, scale)
            state["stage"] = grad_scaler.OptState.READY
            state["found_inf_per_device"] = {}
        self._iteration.unscaled_optimizers = kept


def _multiply_gradients(optimizer: Any, scale: torch.Tensor) -> None:
    """Gradients times the scale, where ``unscale_`` left them.

    With master weights the unscaled gradient is the float32 master's, and
    ``p.grad`` still holds the scaled half-precision one from before: that is
    overwritten with the master's times the scale (finite: never larger than
    what it held), so that backward adds to it and the next ``unscale_``
    copies the sum to the master again.
    """
    dense: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    with torch.no_grad():
        for param, grad in listeners.gradients(optimizer):
            if grad is None:
                continue
            if param.grad is not None and grad is not param.grad:
                param.grad.copy_(grad * scale.to(grad.device))
            elif grad.is_sparse:
                grad.mul_(scale.to(grad.device))
            else:
                dense[grad.device].append(grad)
        for device, grads in dense.items():
            torch._foreach_mul_(grads, scale.to(device))
