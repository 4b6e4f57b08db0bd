"""``clip_grad_norm_`` under a GradScaler: after ``unscale_`` and with ``unscale_`` forgotten.

The reference is the documented recipe (scale, backward, ``unscale_``, clip,
step, update) on plain torch; the float32 model (no autocast, no scaler) gives
the true norm of the first step. ampguard must return the recipe's norms and
leave the recipe's parameters, whether or not the loop called ``unscale_``:
plain torch without ``unscale_`` measures the scaled gradients (a norm
``scale`` times too large) and clips them to almost nothing.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from ampguard.commands.bench.counting import OpCounter
from ampguard.commands.selftest.result import CheckResult, Context, not_ampguards, seeded, verdict
from ampguard.commands.selftest.runner import plain_torch

MAX_NORM = 0.1
# ampguard's extra aten ops (kernel launches on a GPU) per recipe step: docs/performance.md, tests/parity/test_op_count.py.
MAX_EXTRA_OPS = 4
# The first norm under float16 autocast against the float32 model's: float16's own rounding, not a factor of scale.
FLOAT32_TOLERANCE = 1e-2


def train_clipped(
    context: Context,
    steps: int,
    unscale: bool,
    amp: bool = True,
    counter: OpCounter | None = None,
    counted_from: int = 0,
) -> tuple[list[float], torch.nn.Module]:
    """(norm returned per step, model): SGD with ``clip_grad_norm_`` (looked up at each call, as a user's loop does).

    With ``counter``: the aten ops of the steps from ``counted_from`` on are counted in it.
    """
    with seeded(0):
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
    model.to(context.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler(context.device.type, init_scale=1024.0, growth_interval=1000, enabled=amp)
    data = torch.Generator().manual_seed(1)
    norms = []
    for step in range(steps):
        x, y = context.tensor(16, 8, generator=data), 4 * context.tensor(16, 2, generator=data)
        optimizer.zero_grad(set_to_none=True)
        counting = counter if counter is not None and step >= counted_from else contextlib.nullcontext()
        with counting:
            with torch.autocast(context.device.type, dtype=torch.float16, enabled=amp):
                out = model(x)
            scaler.scale(F.mse_loss(out.float(), y)).backward()
            if unscale:
                scaler.unscale_(optimizer)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
            scaler.step(optimizer)
            scaler.update()
    return norms, model


def max_relative_difference(ours: list[float], theirs: list[float]) -> float:
    return max(abs(a - b) / abs(b) if b else abs(a) for a, b in zip(ours, theirs, strict=True))


def parameter_difference(ours: torch.nn.Module, theirs: torch.nn.Module) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(ours.parameters(), theirs.parameters(), strict=True))


def clipping(context: Context, unscale: bool) -> CheckResult:
    name = "clip_after_unscale" if unscale else "clip_without_unscale"
    wrong_class = not_ampguards(name, torch.amp.GradScaler)
    if wrong_class is not None:
        return wrong_class
    steps = context.steps(20, 8)
    with plain_torch():
        recipe_norms, recipe_model = train_clipped(context, steps, unscale=True)
        float32_norms, _ = train_clipped(context, 1, unscale=False, amp=False)
    norms, model = train_clipped(context, steps, unscale=unscale)
    norm_difference = max_relative_difference(norms, recipe_norms)
    weights_difference = parameter_difference(model, recipe_model)
    first_vs_float32 = abs(norms[0] - float32_norms[0]) / float32_norms[0]
    measured = {
        "norms": norms[:3],
        "max_norm_difference": norm_difference,
        "max_parameter_difference": weights_difference,
    }
    reference = {"recipe_norms": recipe_norms[:3], "float32_first_norm": float32_norms[0], "max_norm": MAX_NORM}
    clipped = sum(norm > MAX_NORM for norm in recipe_norms)
    if not clipped:
        return verdict(name, False, measured, reference, "the recipe never clipped: the check proves nothing here")
    ok = (
        all(map(math.isfinite, norms))
        and norm_difference <= 1e-6
        and weights_difference <= 1e-6
        and first_vs_float32 <= FLOAT32_TOLERANCE
    )
    detail = (
        f"{'' if unscale else 'no '}unscale_: first norm {norms[0]:.6g} (recipe {recipe_norms[0]:.6g}, "
        f"float32 {float32_norms[0]:.6g}); norms differ by {norm_difference:.1e} relative, parameters by "
        f"{weights_difference:.1e} over {steps} steps ({clipped} clipped)"
    )
    return verdict(name, ok, measured, reference, detail)


def clip_after_unscale(context: Context) -> CheckResult:
    return clipping(context, unscale=True)


def clip_without_unscale(context: Context) -> CheckResult:
    return clipping(context, unscale=False)


def ops_per_step(context: Context) -> CheckResult:
    """The recipe step (scale, backward, unscale_, clip, step, update) dispatches at most 4 aten ops more than torch's."""
    name = "kernels_per_step"
    wrong_class = not_ampguards(name, torch.amp.GradScaler)
    if wrong_class is not None:
        return wrong_class
    warm, counted = 3, 5  # the first steps make lazy state (scale tensors, momentum buffers)
    torch_ops, ours = OpCounter(), OpCounter()
    with plain_torch():
        train_clipped(context, warm + counted, unscale=True, counter=torch_ops, counted_from=warm)
    train_clipped(context, warm + counted, unscale=True, counter=ours, counted_from=warm)
    extra = (ours.total - torch_ops.total) / counted
    by_op = {op: (n - torch_ops.by_op[op]) / counted for op, n in (ours.by_op | torch_ops.by_op).items()}
    measured = {"ops_per_step": ours.total / counted, "extra_by_op": {op: n for op, n in sorted(by_op.items()) if n}}
    reference = {"ops_per_step": torch_ops.total / counted, "max_extra": MAX_EXTRA_OPS}
    detail = (
        f"{ours.total / counted:g} aten ops (kernels on a GPU) per recipe step, torch {torch_ops.total / counted:g}: "
        f"{extra:+g} (documented: at most +{MAX_EXTRA_OPS})"
    )
    return verdict(name, extra <= MAX_EXTRA_OPS, measured, reference, detail)
