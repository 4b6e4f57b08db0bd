"""fp32 master weights for ``optimizer.step(closure)``: every closure call sees the masters and feeds them.

SGD, Adam and most optimizers call the closure once, before they read the
gradients; LBFGS calls it again after each trial update of the weights.
Lightning steps every optimizer with a closure (``precision="16-true"``, a
float16 model with no scaler, included). The step pre-hook of
:mod:`ampguard.master_weights.step` puts the masters into ``param_groups`` and hands torch a
:class:`MasterClosure` in place of the user's closure, which on each call:

* copies the masters as updated so far, rounded, into the model's parameters
  (not before the first call: the parameters already hold the rounded masters),
  so that the forward pass is run at the point the optimizer is evaluating;
* runs the user's closure with the model's parameters in ``param_groups``, so
  the ``zero_grad()`` and the gradient clipping a closure does (Lightning's)
  act on the gradients backward writes;
* copies those gradients into the masters' float32 ``.grad``, where the
  optimizer reads them.

An optimizer that keeps its own reference to a group's parameter list (LBFGS's
``_params``) has that reference swapped along with ``param_groups``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

__all__ = ["MasterClosure", "begin", "closure_of"]


class Record(Protocol):
    """What a closure step needs of :class:`ampguard.master_weights.records.Masters`."""

    params: list[Tensor]
    masters: list[Tensor]
    model_lists: list[list[Tensor]]
    aliases: tuple[tuple[str, int], ...]

    def swap(self, optimizer: Any, to_masters: bool) -> None: ...


def closure_of(args: Sequence[Any], kwargs: dict[str, Any]) -> Callable[[], Any] | None:
    """The closure of an ``optimizer.step(...)`` call as the step pre-hook sees it (``args[0]`` is the optimizer)."""
    closure = args[1] if len(args) > 1 else kwargs.get("closure")
    return closure if callable(closure) else None


def begin(
    optimizer: Any,
    record: Record,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    closure: Callable[[], Any],
    gradients_in: Callable[[], None],
    give_up: Callable[[Exception], None],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The masters into ``param_groups`` (and their aliases); the step's arguments with a :class:`MasterClosure`."""
    record.aliases = _aliases(optimizer, record.model_lists)
    record.swap(optimizer, to_masters=True)
    return _with_closure(args, kwargs, MasterClosure(optimizer, record, closure, gradients_in, give_up))


def _with_closure(
    args: Sequence[Any], kwargs: dict[str, Any], closure: Callable[[], Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The step's ``(args, kwargs)`` with ``closure`` where the caller passed theirs."""
    if len(args) > 1:
        return (args[0], closure, *args[2:]), kwargs
    return tuple(args), {**kwargs, "closure": closure}


def _aliases(optimizer: Any, model_lists: Sequence[list[Tensor]]) -> tuple[tuple[str, int], ...]:
    """``(attribute, group index)`` for each attribute of ``optimizer`` that is a group's parameter list itself."""
    indices = {id(params): index for index, params in enumerate(model_lists)}
    return tuple(
        (name, indices[id(value)])
        for name, value in vars(optimizer).items()
        if isinstance(value, list) and id(value) in indices and name != "param_groups"
    )


class MasterClosure:
    """The closure torch's optimizer calls, during one step with masters, in place of the user's ``closure``.

    ``gradients_in()`` copies the parameters' gradients into the masters'.
    ``give_up(error)`` is called when that fails: the optimizer is put back as
    torch has it (its parameters in ``param_groups``), and from then on this
    closure is the user's.
    """

    def __init__(
        self,
        optimizer: Any,
        record: Record,
        closure: Callable[[], Any],
        gradients_in: Callable[[], None],
        give_up: Callable[[Exception], None],
    ) -> None:
        self.optimizer = optimizer
        self.record: Record | None = record
        self.closure = closure
        self.gradients_in = gradients_in
        self.give_up = give_up
        self.calls = 0

    def __call__(self) -> Any:
        record = self.record
        if record is None:
            return self.closure()
        if self.calls:
            with torch.no_grad():
                torch._foreach_copy_(record.params, record.masters)
        self.calls += 1
        record.swap(self.optimizer, to_masters=False)
        try:
            loss = self.closure()
        finally:
            record.swap(self.optimizer, to_masters=True)
        try:
            self.gradients_in()
        except Exception as error:  # never the reason a run dies: torch's behaviour from here on
            self.record = None
            self.give_up(error)
        return loss
