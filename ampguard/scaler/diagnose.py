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
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

import ampguard.messages as messages
import ampguard.scaler.listeners as listeners
from ampguard.log import ANY_RANK, event_logger
from ampguard.log import label as log_label
from ampguard.scaler.counters import counters_of
from ampguard.syncs import read_to_host

logger = event_logger("skip")

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
    # Names of parameters found holding inf/NaN at the last report: the collapse and stall messages then
    # blame them, not the loss scale, clipping or bf16 weights.
    corrupt: str = ""


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
    holders = iter(listeners.gradients(optimizer))  # a master's float32 gradient once unscale_ copied it there
    for g, group in enumerate(optimizer.param_groups):
        for i, _ in enumerate(group["params"]):
            param, grad = next(holders)
            if grad is None:
                continue
            yield g, i, param, (grad._values() if grad.is_sparse else grad)


def _weights(optimizer: Any) -> list[tuple[int, int, torch.Tensor]]:
    """The optimizer's parameters, then those of watched models it does not hold (a frozen base), as (g, i, p)."""
    entries = [(g, i, p) for g, group in enumerate(optimizer.param_groups) for i, p in enumerate(group["params"])]
    seen = {id(p) for _, _, p in entries}
    for model in list(_watched):
        for param in model.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                entries.append((-1, -1, param))
    return entries


def _finite(tensors: list[torch.Tensor]) -> list[bool]:
    """Whether each tensor is all finite: one pass over them, one host read for all."""
    if not tensors:
        return []
    home = tensors[0].device
    with torch.no_grad():
        flags = torch.stack([torch.isfinite(t.detach()).all().to(home, non_blocking=True) for t in tensors])
    return [bool(ok) for ok in read_to_host(flags)]


def _nonfinite(optimizer: Any, entries: list[tuple[int, int, torch.Tensor]], finite: list[bool]) -> NonFinite:
    bad = [entry for entry, ok in zip(entries, finite) if not ok]
    return NonFinite(_names_for(optimizer, bad[:NAMES_SHOWN]), len(bad), len(entries))


def nonfinite_parameters(optimizer: Any) -> NonFinite:
    """Which of the optimizer's gradients hold inf/NaN: one pass over them, one host read."""
    return nonfinite_gradients_and_weights(optimizer, weights=False)[0]


def nonfinite_gradients_and_weights(optimizer: Any, *, weights: bool = True) -> tuple[NonFinite, NonFinite]:
    """Gradients of the optimizer, and weights (its own and watched models'), holding inf/NaN: one host read."""
    grads = list(_grads(optimizer))
    params = _weights(optimizer) if weights else []
    finite = _finite([grad for *_, grad in grads] + [p for _, _, p in params])
    return (
        _nonfinite(optimizer, [(g, i, p) for g, i, p, _ in grads], finite[: len(grads)]),
        _nonfinite(optimizer, params, finite[len(grads) :]),
    )


def _names_for(optimizer: Any, params: list[tuple[int, int, torch.Tensor]]) -> list[str]:
    if not params:
        return []
    by_id: dict[int, str] = {}
    for model, prefix in list(_watched.items()):
        for parameter_name, parameter in model.named_parameters():
            by_id.setdefault(id(parameter), prefix + parameter_name)
    names = []
    for g, i, param in params:
        name = by_id.get(id(param))
        if name is None and g >= 0:
            group_names = optimizer.param_groups[g].get("param_names")
            if group_names is not None and i < len(group_names):
                name = str(group_names[i])
        if name is None:
            shape = "x".join(str(s) for s in param.shape) or "scalar"
            where = f"param_groups[{g}][{i}]" if g >= 0 else "a watched model's parameter"
            name = f"{where} ({shape} {str(param.dtype).replace('torch.', '')})"
        names.append(name)
    return names


def names_known(optimizer: Any) -> bool:
    return bool(_watched) or any("param_names" in group for group in optimizer.param_groups)


def parameters_note(scaler: Any) -> str:
    """For the collapse and stall messages: a sentence naming parameters found holding inf/NaN, or ""."""
    state = _states.get(scaler)
    return messages.PARAMETERS_NOTE.format(names=state.corrupt) if state is not None and state.corrupt else ""


def _listed(found: NonFinite) -> str:
    more = f" and {found.total - len(found.names)} more" if found.total > len(found.names) else ""
    return ", ".join(found.names) + more


def _report(scaler: Any, optimizer: Any, *, loss_nonfinite: bool, step: int, unreported: int, every: int) -> None:
    found, weights = nonfinite_gradients_and_weights(optimizer)
    counters = counters_of(scaler)
    scale = counters.mirror_scale if counters is not None else None
    at_scale = f" at loss scale {scale:g}" if isinstance(scale, float) else ""
    label = log_label(optimizer)
    state = _states.get(scaler)
    if state is not None:
        state.corrupt = _listed(weights) if weights.total else ""
    hint = "" if names_known(optimizer) else " (ampguard.watch(model) names them.)"
    if weights.total:  # said first: whatever else happened, these parameters make every step fail
        message = messages.PARAMETERS_NONFINITE.format(
            step=step,
            at_scale=at_scale,
            total=weights.total,
            checked=weights.with_grad,
            optimizer=label,
            names=_listed(weights),
            hint=hint,
        )
        level = logging.ERROR
    elif loss_nonfinite:
        message = (
            f"step {step} skipped{at_scale}: forward overflow: the loss itself was inf/NaN before scaling, "
            f"so no loss scale can help.{_gradients_of_a_nonfinite_loss(found, label)} Likely causes: activations beyond "
            "float16's range (65504) in the forward pass, typical of weights pretrained in bfloat16 (run that block "
            "in float32 with torch.autocast(..., enabled=False), or train in bf16 on a GPU with native bf16); "
            "a bad batch; log(0) or a division by zero in the loss."
        )
        level = logging.WARNING
    else:
        message = (
            f"step {step} skipped{at_scale}: backward overflow: the loss was finite, the gradients were not. "
            f"{_gradients_found(found, label, hint)} The scaler lowers the scale and retries; a few such skips "
            "while it calibrates are normal. If they persist: lower the learning rate, clip gradients after "
            "scaler.unscale_(), or keep the named layers in float32."
        )
        if found.total > 1 and found.total == found.with_grad:
            message += (
                " Every gradient is non-finite: if clip_grad_norm_ ran, its inf/NaN total norm spread NaN "
                "to all of them, and the layers that overflowed first cannot be told apart here."
            )
        level = logging.INFO
    if unreported:
        what = (
            "skipped step since the previous report was"
            if unreported == 1
            else "skipped steps since the previous report were"
        )
        message += f" ({unreported} {what} not described.)"
    if every > 0:
        # One skipped step is described per stats interval: the rest of this one are only counted.
        start = ((step - 1) // every + 1) * every + 1
        if start - 1 > step:
            message += (
                f" (Further skipped steps up to step {start - 1} are counted in the stats line but not described; "
                f"the first one from step {start} on is described again.)"
            )
    global _own_loss_told
    if loss_nonfinite and not _own_loss_told:
        # Under DDP the other ranks see only inf/NaN gradients: that this rank's loss was inf/NaN is
        # known here alone, so it is said once from whichever rank this is.
        _own_loss_told = True
        logger.log(level, message, extra=ANY_RANK)
        return
    logger.log(level, message)


_own_loss_told = False


def _gradients_of_a_nonfinite_loss(found: NonFinite, label: str) -> str:
    """After an inf/NaN loss: how many gradients are inf/NaN, not which (computed from that loss, they say nothing)."""
    if not found.total:
        return ""
    return (
        f" Its backward pass made the gradients of {found.total} of the {found.with_grad} parameters of {label} "
        "inf/NaN, so they do not show where the overflow began."
    )


def _gradients_found(found: NonFinite, label: str, hint: str) -> str:
    if found.total:
        return (
            f"inf/NaN gradients in {found.total} of the {found.with_grad} parameters of {label} "
            f"that have gradients: {_listed(found)}.{hint}"
        )
    return (
        f"No gradient of {label} holds inf/NaN any more: the overflow flag was raised elsewhere "
        "(by another rank's gradients under DDP/FSDP, or by a clip_grad_norm_ that found an inf/NaN norm)."
    )
