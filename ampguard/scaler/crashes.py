"""The classic GradScaler crashes, handled: where torch's scaler raises, SafeGradScaler carries on.

* an optimizer whose parameters have no gradient (torch: "No inf checks were
  recorded for this optimizer"): stepped as in float32, with one warning;
* float16 gradients (torch: "Attempting to unscale FP16 gradients"): unscaled,
  with one warning, or torch's error with ``AMPGUARD_FP16_GRADS=error``;
* bfloat16 gradients on a device whose unscale kernel lacks them (CUDA,
  pytorch issue 127176): unscaled with ops that accept them;
* a second ``unscale_()`` in one iteration (torch: "unscale_() has already been
  called on this optimizer since the last update()"): a no-op.

The checks that tell those cases (one comparison each) sit in
:meth:`SafeGradScaler.unscale_` and :meth:`SafeGradScaler.step`, on the path
every step takes; the handling is here.

A positional closure with no gradients still raises torch's AssertionError: its
gradients would be made now, scaled and unchecked.
"""

from __future__ import annotations

from typing import Any

import torch

import ampguard.messages as messages
import ampguard.scaler.listeners as listeners
from ampguard.log import event, label, logger
from ampguard.scaler.parts import ScalerParts

try:
    from torch.amp.grad_scaler import OptState, _MultiDeviceReplicator
except ImportError:  # a torch that renamed them: the grad_scaler patch reports itself unavailable
    OptState = _MultiDeviceReplicator = None  # type: ignore[assignment, misc]


# Device types whose _amp_foreach_non_finite_check_and_unscale_ kernel has no
# bfloat16 implementation (pytorch issue 127176).
DEVICES_WITHOUT_BF16_UNSCALE = frozenset({"cuda"})


def unscale_without_kernel_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """What ``_amp_foreach_non_finite_check_and_unscale_`` does, with ops that accept bfloat16 everywhere."""
    finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
    found_inf.copy_(torch.where(finite, found_inf, torch.ones_like(found_inf)))
    torch._foreach_mul_(grads, inv_scale)


class CrashGuards(ScalerParts):
    """Where torch's scaler raises on an optimizer without gradients, float16/bfloat16 gradients: SafeGradScaler's
    methods that carry on."""

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        """torch's ``_unscale_grads_`` loop, plus: float16 parameters allowed (with one warning, or
        torch's error with AMPGUARD_FP16_GRADS=error) and bfloat16 gradients unscaled without the
        CUDA kernel that lacks them."""
        refuse_fp16 = not allow_fp16 and self._settings.fp16_grads == "error"
        per_device_inv_scale = _MultiDeviceReplicator(inv_scale)
        per_device_found_inf = _MultiDeviceReplicator(found_inf)
        grouped: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = {}
        saw_fp16 = False
        with torch.no_grad():
            # Half-precision parameters with fp32 master weights: their gradients, copied into the masters
            # (listeners.gradients, inline: every unscale_).
            holders = listeners.gradient_holders
            pairs = (
                holders.of_optimizer(optimizer, None if refuse_fp16 else self)
                if holders is not None
                else [(p, p.grad) for group in optimizer.param_groups for p in group["params"]]
            )
            for param, grad in pairs:
                if grad is None:
                    continue
                if grad.dtype == torch.float16:
                    if refuse_fp16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    saw_fp16 = True
                if grad.is_sparse:
                    if grad.dtype is torch.float16:
                        param.grad = grad = grad.coalesce()
                    grad = grad._values()
                grouped.setdefault(grad.device, {}).setdefault(grad.dtype, []).append(grad)
            for device, per_dtype in grouped.items():
                for dtype, grads in per_dtype.items():
                    if dtype == torch.bfloat16 and device.type in DEVICES_WITHOUT_BF16_UNSCALE:
                        unscale_without_kernel_(
                            grads, per_device_found_inf.get(device), per_device_inv_scale.get(device)
                        )
                    else:
                        torch._amp_foreach_non_finite_check_and_unscale_(
                            grads, per_device_found_inf.get(device), per_device_inv_scale.get(device)
                        )
        if saw_fp16 and not allow_fp16 and not self._counters.warned_fp16:
            self._counters.warned_fp16 = True
            logger.warning(messages.FP16_GRADIENTS.format(optimizer=label(optimizer)))
        return per_device_found_inf._per_device_tensors

    def _step_without_gradients(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any], *args: Any, **kwargs: Any
    ) -> Any:
        """The optimizer's own step, as in float32, where torch raises "No inf checks were recorded"."""
        if args and callable(args[0]):
            # A positional closure would make the gradients now, scaled and unchecked: torch's error.
            raise AssertionError(messages.NO_INF_CHECKS_CLOSURE)
        self._note_no_gradients(optimizer)
        result = optimizer.step(*args, **kwargs)
        state["stage"] = OptState.STEPPED
        return result

    def _note_no_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        self._counters.no_grad_steps += 1
        if id(optimizer) not in self._counters.warned_no_grad:
            self._counters.warned_no_grad.add(id(optimizer))
            logger.warning(messages.NO_GRADIENTS.format(optimizer=label(optimizer)), extra=event("no_grad"))
