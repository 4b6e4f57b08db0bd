"""The float32 reference of issue 32: which float16 gradient values are lost, computed directly.

A value is lost where float16 holds an exact zero and float32, with the same weights and batch, holds it nonzero
(docs/underflow.md). :func:`float32_lost_share` runs the model's backward pass at the same loss scale under
float16 autocast and in float32, with tensor hooks on every leaf module's outputs and the gradients of the
parameters float16 made (the gradients the sampler counts, module by module), and counts the positions zero in the first and nonzero in
the second; :func:`measured` is the sampler's estimate of the same share from float16 alone. The tolerance
stated in docs/underflow.md: :func:`within_tolerance`. ``scale``: the loss scale of both passes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ampguard.underflow.counts import SMALLEST_NORMAL, Measurement, read
from ampguard.underflow.measure import Sampler

SCALE = 1024.0
Loss = Callable[[bool], torch.Tensor]  # loss(fp16): the loss under float16 autocast, or in float32


def within_tolerance(measured: float, reference: float, factor: float = 2.0) -> bool:
    """Within 0.5 percentage points of float32's share, or within ``factor`` of it (2 for the values' share, 3 for
    the norm's, docs/underflow.md)."""
    return abs(measured - reference) <= 0.005 or reference / factor <= measured <= reference * factor


def gradients(
    model: nn.Module, loss: Loss, fp16: bool, scale: float = SCALE, half: set[str] | None = None
) -> tuple[dict[str, list[torch.Tensor]], set[str]]:
    """Per leaf module: its outputs' gradients (float16 ones only under autocast) and the gradients of its
    parameters where float16 made them (its output was float16 under autocast, ``half`` for the float32 pass: a
    LayerNorm's are float32's own). Returns them and the modules whose output was float16."""
    found: dict[str, list[torch.Tensor]] = {}
    leaves = {name: module for name, module in model.named_modules() if name and not any(module.children())}
    made_half: set[str] = set()

    def keep(name: str, tensor: torch.Tensor) -> None:
        if tensor.dtype == torch.float16:
            made_half.add(name)
        if tensor.requires_grad and (tensor.dtype == torch.float16 or not fp16):
            tensor.register_hook(lambda grad: found.setdefault(name, []).append(grad.detach().float()))

    handles = [
        module.register_forward_hook(lambda _m, _i, out, name=name: keep(name, out)) for name, module in leaves.items()
    ]
    model.zero_grad(set_to_none=True)
    try:
        (loss(fp16) * scale).backward()
    finally:
        for handle in handles:
            handle.remove()
    half = made_half if half is None else half
    for name, module in leaves.items():
        if name in half:
            found.setdefault(name, []).extend(p.grad.float() for p in module.parameters() if p.grad is not None)
    return found, made_half


def float32_lost(model: nn.Module, loss: Loss, scale: float = SCALE) -> tuple[float, float]:
    """The share of the float16 gradients' values that are exact zeros where float32's are not, and the share of
    float32's norm those values hold (the norm of float32's gradients at those positions against all of it). For
    the norm, only positions whose float32 value is below float16's smallest normal: a larger one zero in float16
    is a ReLU mask the forward's rounding moved, not an underflow (it carries 0.34% of a healthy ReLU stack's
    norm here, at 0.003% of its values)."""
    half, made_half = gradients(model, loss, True, scale)
    full, _ = gradients(model, loss, False, scale, made_half)
    values = lost = 0
    lost_square = whole_square = 0.0
    for name, tensors in half.items():
        if not tensors:
            continue
        # float32 has no float16 outputs to select: take its gradients of the same shapes, in the same order
        same = [t for t in full[name] if any(t.shape == h.shape for h in tensors)][-len(tensors) :]
        for h, f in zip(tensors, same):
            where = (h == 0) & (f != 0)
            values += h.numel()
            lost += int(where.sum())
            lost_square += float(f.double()[where & (f.abs() < SMALLEST_NORMAL)].square().sum())
            whole_square += float(f.double().square().sum())
    return lost / values, (lost_square / whole_square) ** 0.5 if whole_square > 0 else 0.0


def float32_lost_share(model: nn.Module, loss: Loss, scale: float = SCALE) -> float:
    """The share of the float16 gradients' values that are exact zeros where float32's are not."""
    return float32_lost(model, loss, scale)[0]


def measured(model: nn.Module, loss: Loss, scale: float = SCALE) -> Measurement:
    sampler = Sampler()
    sampler.arm()
    model.zero_grad(set_to_none=True)
    (loss(True) * scale).backward()
    sampler.count_parameters(model.parameters())  # (what its scaler's unscale_() has it do)
    return read(sampler.finish(), step=2, scale=scale)[0]
