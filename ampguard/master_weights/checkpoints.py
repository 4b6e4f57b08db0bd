"""The masters in checkpoints and copies, and masters that follow a model loaded under them.

* ``Optimizer.state_dict`` / ``load_state_dict`` see the masters as the
  parameters (the state is saved and loaded in float32) and carry the masters
  under :data:`~ampguard.master_weights.records.STATE_KEY`.
* ``Optimizer.__getstate__`` (``copy.deepcopy``, pickle, ``torch.save`` of the
  optimizer object) carries which master is whose and their float32 state:
  the copy steps the copied masters with the copied state. Its torch-visible
  state is keyed by the parameters and cast to their dtype, so that a copy
  loaded without ampguard steps like a torch optimizer.
* ``Module.load_state_dict`` marks the optimizers holding the loaded
  parameters: their masters are refreshed at the next step (a rollback to the
  best checkpoint is not undone by the masters of the weights it replaced).
  Ordinary steps pay nothing for it.
* ``Optimizer.zero_grad`` frees the masters' gradients too.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch

from ampguard.log import event_logger
from ampguard.master_weights.records import (
    ATTRIBUTE,
    FAILED,
    STATE_KEY,
    Masters,
    MastersOwner,
    MasterWeights,
    fail,
    label,
    pickled,
    record_of,
)
from ampguard.master_weights.state_moves import cast_state

logger = event_logger("masters")


def _current(owner: MastersOwner, optimizer: Any) -> Masters | None:
    masters = owner.masters
    if masters is None:
        return None
    entry = getattr(optimizer, "__dict__", {}).get(ATTRIBUTE)
    return record_of(masters, optimizer, create=isinstance(entry, Masters))


def wrap_state_dict(original: Callable[..., dict[str, Any]], owner: MastersOwner) -> Callable[..., dict[str, Any]]:
    @functools.wraps(original)
    def state_dict(self: Any) -> dict[str, Any]:
        record = _current(owner, self)
        if record is None or not record.params:
            return original(self)
        record.swap(self, to_masters=True)
        try:
            result = original(self)
        finally:
            record.swap(self, to_masters=False)
        position: dict[int, int] = {}
        for param in (p for params in record.model_lists for p in params):
            position.setdefault(id(param), len(position))
        result[STATE_KEY] = {position[id(p)]: m.detach() for p, m in zip(record.params, record.masters)}
        return result

    return state_dict


def wrap_load_state_dict(original: Callable[..., None], owner: MastersOwner) -> Callable[..., None]:
    @functools.wraps(original)
    def load_state_dict(self: Any, state_dict: dict[str, Any]) -> None:
        masters = owner.masters
        try:
            record = record_of(masters, self, create=True) if masters is not None else None
        except Exception as error:
            logger.warning(FAILED.format(optimizer=label(self), error=repr(error)))
            record = None
        if record is None or not record.params:
            return original(self, state_dict)
        saved = state_dict.get(STATE_KEY)
        record.swap(self, to_masters=True)  # torch casts the float state to the masters' float32, not float16
        try:
            original(self, state_dict)
        finally:
            record.swap(self, to_masters=False)  # torch made new group dicts: the model's lists go into those
        order = [p for params in record.model_lists for p in params]
        if saved:
            with torch.no_grad():
                for index, tensor in saved.items():
                    master = record.master_of.get(id(order[int(index)]))
                    if master is not None:
                        master.copy_(tensor)
            record.refresh = "check"  # the model may be loaded after the optimizer, or from elsewhere
        else:
            record.refresh = "exact"  # saved without master weights: rebuilt from the parameters at the next step

    return load_state_dict


def wrap_zero_grad(original: Callable[..., None], owner: MastersOwner) -> Callable[..., None]:
    @functools.wraps(original)
    def zero_grad(self: Any, *args: Any, **kwargs: Any) -> None:
        masters, record = owner.masters, None
        if masters is not None:
            try:
                record = record_of(masters, self, create=False)
                if record is not None:
                    record.free_grads(masters)
            except Exception as error:  # never the reason a run dies: torch's behaviour from here on
                fail(masters, self, record, error)
        return original(self, *args, **kwargs)

    return zero_grad


def wrap_getstate(original: Callable[..., dict[str, Any]], owner: MastersOwner) -> Callable[..., dict[str, Any]]:
    @functools.wraps(original)
    def __getstate__(self: Any) -> dict[str, Any]:
        result = original(self)
        try:
            record = _current(owner, self)
            if record is not None and record.params:
                keyed = copy.copy(result["state"])  # as torch's own copy would be, see records.pickled
                for param, master in zip(record.params, record.masters):
                    if master in keyed:
                        keyed[param] = cast_state(keyed.pop(master), param.dtype)
                return {**result, "state": keyed, ATTRIBUTE: pickled(self, record)}
        except Exception as error:  # the copy is torch's: it makes new masters at its first step
            logger.warning(FAILED.format(optimizer=label(self), error=repr(error)))
        return result

    return __getstate__


def wrap_module_load_state_dict(original: Callable[..., Any], owner: MastersOwner) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_state_dict(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        masters = owner.masters
        if masters is not None and len(masters.records):
            try:
                _refresh_loaded(masters, self)
            except Exception as error:
                logger.warning("ampguard could not refresh the master weights of the loaded model: %r", error)
        return result

    return load_state_dict


def _refresh_loaded(masters: MasterWeights, module: torch.nn.Module) -> None:
    """Every record holding a parameter (or one over the same memory) of ``module`` refreshes its masters."""
    loaded = {(p.device, p.untyped_storage().data_ptr()) for p in module.parameters()}
    for record in list(masters.records):
        if record.refresh is None and any((p.device, p.untyped_storage().data_ptr()) in loaded for p in record.params):
            record.refresh = "check"
