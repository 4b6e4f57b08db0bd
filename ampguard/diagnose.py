"""Where the NaN came from: called by SafeGradScaler on skipped steps only.

On a healthy step nothing here runs: the scaler calls :func:`on_skipped_step`
only from the branch of ``_maybe_opt_step`` that has already learnt, through
the one host read torch makes anyway, that the step overflowed.

On a skipped step the report says whether the loss itself was non-finite
(a forward overflow: no loss scale can help) or only the gradients (a backward
overflow: the scaler backs off and retries), and names the parameters whose
gradients are inf/NaN: the first few and how many in all. Finding them costs
one pass over the optimizer's gradients and one host read, so it runs only
when a report is due: at the first skipped step, then at most once per stats
interval (``AMPGUARD_STATS_EVERY`` optimizer steps); the other skipped steps
cost a counter increment.

Names come from models passed to :func:`watch`, else from the optimizer's
``param_groups[...]["param_names"]`` (recent torch fills it when the optimizer
is built from ``model.named_parameters()``), else a position and shape.
Optimizers that skip on the device (``fused=True``) are never reported: torch
never tells the host that they skipped.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ampguard.log import logger
from ampguard.syncs import read_to_host

NAMES_SHOWN = 5

_watched: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()


def watch(model: torch.nn.Module, *, prefix: str = "") -> torch.nn.Module:
    """Let ampguard name ``model``'s parameters in skipped-step reports; returns ``model``.

    Free: only a weak reference is kept, and names are looked up when a report
    is written. ``prefix`` tells several watched models apart (``"generator."``).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"ampguard.watch() takes a torch.nn.Module, got {type(model).__name__}")
    _watched[model] = prefix
    return model


@dataclass
class _ReportState:
    last_step: int | None = None
    last_interval: int | None = None
    # The scaler's per-iteration dict when the last report was written: torch's
    # update() replaces it, so the same object means the same iteration.
    iteration: Any = None
    unreported: int = 0


_states: weakref.WeakKeyDictionary[Any, _ReportState] = weakref.WeakKeyDictionary()


def _report_due(state: _ReportState, step: int, every: int, scaler: Any = None) -> bool:
    """First skipped step, then once per stats interval; every optimizer of a described iteration is described."""
    if state.last_step is None or step == state.last_step:
        return True
    if state.iteration is not None and getattr(scaler, "_per_optimizer_states", None) is state.iteration:
        return True
    interval = (step - 1) // every if every > 0 else 0
    return interval != state.last_interval


def on_skipped_step(scaler: Any, optimizer: Any, *, loss_nonfinite: bool, step: int) -> None:
    """Explain a step the scaler skipped: forward or backward overflow, and which parameters.

    Never raises: a diagnostic must not be the reason a training run dies.
    """
    try:
        settings = getattr(scaler, "_settings", None)
        every = int(getattr(settings, "stats_every", 0) or 0)
        state = _states.get(scaler)
        if state is None:
            state = _states[scaler] = _ReportState()
        if not _report_due(state, step, every, scaler):
            state.unreported += 1
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("step %d skipped (%s overflow)", step, "forward" if loss_nonfinite else "backward")
            return
        unreported, state.unreported = state.unreported, 0
        state.last_step = step
        state.iteration = getattr(scaler, "_per_optimizer_states", None)
        state.last_interval = (step - 1) // every if every > 0 else 0
        _report(scaler, optimizer, loss_nonfinite=loss_nonfinite, step=step, unreported=unreported, every=every)
    except Exception as error:
        logger.debug("ampguard could not explain skipped step %d: %r", step, error)


@dataclass(frozen=True)
class NonFinite:
    """The parameters of one optimizer whose gradients hold inf/NaN."""

    names: list[str]
    total: int
    with_grad: int


def _grads(optimizer: Any) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            grad = param.grad
            if grad is None:
                continue
            yield g, i, param, (grad._values() if grad.is_sparse else grad)


def nonfinite_parameters(optimizer: Any) -> NonFinite:
    """Which of the optimizer's gradients hold inf/NaN: one pass over them, one host read."""
    entries = list(_grads(optimizer))
    if not entries:
        return NonFinite([], 0, 0)
    home = entries[0][3].device
    with torch.no_grad():
        flags = torch.stack([torch.isfinite(grad).all().to(home, non_blocking=True) for _, _, _, grad in entries])
    finite = read_to_host(flags)
    bad = [(g, i, param) for (g, i, param, _), ok in zip(entries, finite) if not ok]
    return NonFinite(_names_for(optimizer, bad[:NAMES_SHOWN]), len(bad), len(entries))


def _names_for(optimizer: Any, params: list[tuple[int, int, torch.Tensor]]) -> list[str]:
    if not params:
        return []
    by_id: dict[int, str] = {}
    for model, prefix in list(_watched.items()):
        for name, param in model.named_parameters():
            by_id.setdefault(id(param), prefix + name)
    names = []
    for g, i, param in params:
        name = by_id.get(id(param))
        if name is None:
            group_names = optimizer.param_groups[g].get("param_names")
            if group_names is not None and i < len(group_names):
                name = str(group_names[i])
        if name is None:
            shape = "x".join(str(s) for s in param.shape) or "scalar"
            name = f"param_groups[{g}][{i}] ({shape} {str(param.dtype).replace('torch.', '')})"
        names.append(name)
    return names


def names_known(optimizer: Any) -> bool:
    return bool(_watched) or any("param_names" in group for group in optimizer.param_groups)


def _report(scaler: Any, optimizer: Any, *, loss_nonfinite: bool, step: int, unreported: int, every: int) -> None:
    found = nonfinite_parameters(optimizer)
    scale = getattr(scaler, "_mirror_scale", None)
    at_scale = f" at loss scale {scale:g}" if isinstance(scale, float) else ""
    label = f"{type(optimizer).__name__}#{id(optimizer) & 0xFFFF:04x}"
    if found.total:
        shown = ", ".join(found.names)
        more = f" and {found.total - len(found.names)} more" if found.total > len(found.names) else ""
        which = (
            f"inf/NaN gradients in {found.total} of the {found.with_grad} parameters of {label} "
            f"that have gradients: {shown}{more}."
        )
        if not names_known(optimizer):
            which += " (ampguard.watch(model) names them.)"
    else:
        which = (
            f"No gradient of {label} holds inf/NaN any more: the overflow flag was raised elsewhere "
            "(by another rank's gradients under DDP/FSDP, or by a clip_grad_norm_ that found an inf/NaN norm)."
        )
    if loss_nonfinite:
        message = (
            f"step {step} skipped{at_scale}: forward overflow: the loss itself was inf/NaN before scaling, "
            f"so no loss scale can help. {which} Likely causes: activations beyond float16's range (65504) in "
            "the forward pass, typical of weights pretrained in bfloat16 (run that block in float32 with "
            "torch.autocast(..., enabled=False), or train in bf16 on a GPU with native bf16); a bad batch; "
            "log(0) or a division by zero in the loss."
        )
        level = logging.WARNING
    else:
        message = (
            f"step {step} skipped{at_scale}: backward overflow: the loss was finite, the gradients were not. "
            f"{which} The scaler lowers the scale and retries; a few such skips while it calibrates are normal. "
            "If they persist: lower the learning rate, clip gradients after scaler.unscale_(), or keep the "
            "named layers in float32."
        )
        if found.total > 1 and found.total == found.with_grad:
            message += (
                " Every gradient is non-finite: if clip_grad_norm_ ran, its inf/NaN total norm spread NaN "
                "to all of them, and the layers that overflowed first cannot be told apart here."
            )
        level = logging.INFO
    if unreported:
        what = "skipped step since the previous report was" if unreported == 1 else "skipped steps since the previous report were"
        message += f" ({unreported} {what} not described.)"
    if every > 0:
        message += f" (Next description from step {((step - 1) // every + 1) * every + 1} on.)"
    logger.log(level, message)
