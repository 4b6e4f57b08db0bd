"""Which tensor holds a parameter's gradient: the float32 master's, from the copy (``unscale_``/step) to the step."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

import ampguard.master_weights.storage as storage
from ampguard.master_weights.records import Masters, MasterWeights, Unwrappable, exclude, fail, record_of


def sync(masters: MasterWeights, optimizer: Any, record: Masters, gradients: bool = True) -> Masters | None:
    """Copy the half-precision gradients into the masters' (float32) ``.grad``; the record in use, or None.

    ``gradients=False``: only bring the masters up to date (a closure step copies the gradients after each call).
    """
    # A frozen parameter started training: its master now (in a closure step its gradient comes later).
    if any(p.grad is not None or (not gradients and p.requires_grad) for p in record.waiting):
        rebuilt = record_of(masters, optimizer, create=True, rebuild=True)
        if rebuilt is None:  # excluded on the way (and said so)
            return None
        record = rebuilt
    if record.refresh is not None:
        refresh(record)
    if gradients:
        copy_gradients(masters, record)
    return record


@torch.no_grad()
def copy_gradients(masters: MasterWeights, record: Masters) -> None:
    """The parameters' gradients into the masters' float32 ``.grad``."""
    sources, targets = [], []
    shared = record.shared
    for param, master in zip(record.params, record.masters):
        grad = param.grad
        if grad is None:
            master.grad = None
            continue
        if grad.layout is not torch.strided:
            raise Unwrappable("it receives sparse gradients")
        if master.grad is None:
            master.grad = (
                _shared_grad(masters, param, master) if shared and id(param) in shared else torch.empty_like(master)
            )
        sources.append(grad)
        targets.append(master.grad)
    if sources:
        torch._foreach_copy_(targets, sources)


def _shared_grad(masters: MasterWeights, param: Tensor, master: Tensor) -> Tensor:
    """The float32 gradient every optimizer holding ``param`` uses (each copy and unscale writes the same value)."""
    grad = masters.shared_grads.get(id(param))
    if grad is None or grad.shape != master.shape:
        grad = masters.shared_grads[id(param)] = torch.empty_like(master)
    return grad


@torch.no_grad()
def refresh(record: Masters) -> None:
    """After a load: masters from the parameters ("exact"), or only where they no longer round to them ("check")."""
    if record.refresh == "exact":
        torch._foreach_copy_(record.masters, record.params)
    else:  # keep the loaded float32 value wherever it still rounds to the parameter: no host read
        for param, master in zip(record.params, record.masters):
            storage.take_where_changed(master, param)
    record.refresh = None


def synced_gradients(masters: MasterWeights, optimizer: Any, scaler: Any = None) -> list[tuple[Tensor, Tensor | None]]:
    """:func:`ampguard.master_weights.step.gradients` for an optimizer that may have masters: with ``scaler``
    (its ``unscale_``) the half-precision gradients are copied into the masters first."""
    record = None
    try:
        record = record_of(masters, optimizer, create=scaler is not None)
        if record is not None and scaler is not None:
            record = sync(masters, optimizer, record)
            if record is not None:
                record.sync_scaler, record.sync_states = weakref.ref(scaler), scaler._per_optimizer_states
                masters.synced.add(record)
    except Unwrappable as why:
        exclude(masters, optimizer, str(why), record)
        record = None
    except Exception as error:  # never the reason a run dies: the scaler unscales the parameters' gradients
        fail(masters, optimizer, record, error)
        record = None
    if record is None or not record.synced():
        return [(p, p.grad) for group in optimizer.param_groups for p in group["params"]]
    master_of = record.master_of
    return [
        (p, master_of[id(p)].grad if id(p) in master_of else p.grad)
        for group in optimizer.param_groups
        for p in group["params"]
    ]


def gradient_pairs(masters: MasterWeights, params: Iterable[Tensor]) -> list[tuple[Tensor, Tensor]]:
    """``(parameter, gradient)`` for each of ``params`` with a gradient: the master's when it holds this iteration's."""
    lookup: dict[int, Tensor] = {}
    for record in list(masters.synced):
        if record.synced():
            lookup.update(record.master_of)
    if not lookup:
        return [(p, p.grad) for p in params if p.grad is not None]
    pairs = []
    for p in params:
        master = lookup.get(id(p))
        grad = p.grad if master is None else master.grad
        if grad is not None:
            pairs.append((p, grad))
    return pairs
