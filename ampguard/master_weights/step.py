"""One iteration's entries into master weights: the gradients at ``unscale_``, then the step, where the masters go
into ``param_groups`` for the length of ``optimizer.step()`` and always come back.

Both run for every optimizer (masters are made at an optimizer's first
``unscale_`` or ``step``); one without half-precision parameters is answered in
their first lines (:func:`gradients`, :func:`before_step`).

torch's step wrapper runs the step pre-hooks (global ones, then the
optimizer's own: :func:`swap_in`, kept last), the step, then the post-hooks;
an exception anywhere in between (Ctrl-C, an out-of-memory error while the
optimizer allocates its state, an error in a step hook) skips the post-hooks.
The optimizer must then be as torch's in-place step would leave it: the
model's parameters in ``param_groups``, holding whatever the step wrote before
it stopped. :func:`put_back_on_error` wraps each optimizer class's hooked
``step`` (those torch hooks while ampguard is installed through
``Optimizer.profile_hook_step``, and those it had hooked before) to do that
at once; any entry into this package finds a record still ``swapped`` and
does the same (a step function captured earlier, as an LR scheduler does).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

import ampguard.master_weights.closure as closure
import ampguard.master_weights.gradient_copies as gradient_copies
import ampguard.master_weights.handles as handles
from ampguard.log import event_logger
from ampguard.master_weights.records import (
    ATTRIBUTE,
    PRE_HOOK,
    Excluded,
    Masters,
    MastersOwner,
    MasterWeights,
    Plain,
    Unwrappable,
    exclude,
    fail,
    label,
    record_of,
)

logger = event_logger("masters")

_PUTS_BACK = "_ampguard_puts_masters_back"


def gradients(owner: MastersOwner, optimizer: Any, scaler: Any = None) -> list[tuple[Tensor, Tensor | None]]:
    """``(parameter, the tensor holding its gradient)`` for every parameter of ``optimizer``, in param_groups order.

    With ``scaler`` (called from its ``unscale_``), the half-precision gradients
    are first copied into the float32 masters, which the scaler then unscales.
    (The scaler and the clip find it, bound to the patch, on their bus: ``listeners.gradient_holders``.)
    """
    masters = owner.masters
    if masters is None:  # (reverted meanwhile)
        return [(p, p.grad) for group in optimizer.param_groups for p in group["params"]]
    entry = getattr(optimizer, "__dict__", {}).get(ATTRIBUTE)
    if entry.__class__ is Plain:  # the float32 optimizer's path: records.quick(), inlined (every unscale_)
        groups = optimizer.param_groups
        last = groups[-1]["params"] if groups else ()
        if entry.signature == (len(groups), id(last), len(last)):
            return [(p, p.grad) for group in groups for p in group["params"]]
    return gradient_copies.synced_gradients(masters, optimizer, scaler)


def before_step(
    owner: MastersOwner, optimizer: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Global optimizer step pre-hook: the optimizer's record up to date, and :func:`swap_in` last of its pre-hooks.

    torch runs the global step pre-hooks first, then the optimizer's own: swapping here would show the masters to
    every pre-hook of the user's (a gradient mask keyed by the model's parameters would find nothing). The swap is
    the optimizer's own last pre-hook instead, so that the user's see their own parameters, as under torch.
    """
    masters = owner.masters
    if masters is None:
        return None
    entry = optimizer.__dict__.get(ATTRIBUTE)
    if entry.__class__ is Plain:  # the float32 optimizer's path: records.quick(), inlined (every step)
        groups = optimizer.param_groups
        last = groups[-1]["params"] if groups else ()
        if entry.signature == (len(groups), id(last), len(last)):
            return None
    # An inner step (a subclass's super().step(), step_depth above 1): its hooks see the model's
    if entry.__class__ is Masters and masters.step_depth.get(id(optimizer), 0) > 1:
        if entry.swapped:
            entry.swap(optimizer, to_masters=False)
        return None
    record = None
    try:
        record = record_of(masters, optimizer, create=True)
        if record is not None and not _last_pre_hook(owner, optimizer):
            return swap_in(owner, optimizer, args, kwargs)  # no hook of its own: here, before the user's
    except Exception as error:  # never the reason a run dies: torch's behaviour from here on
        _give_up(masters, optimizer, record, error)
    return None


def _last_pre_hook(owner: MastersOwner, optimizer: Any) -> bool:
    """Put :func:`swap_in` last among the optimizer's own step pre-hooks (False: it cannot have one)."""
    hooks = getattr(optimizer, "_optimizer_step_pre_hooks", None)
    if not isinstance(hooks, dict):
        return False
    handle = optimizer.__dict__.get(PRE_HOOK)
    if handle is None or handle.id not in hooks:
        optimizer.__dict__[PRE_HOOK] = optimizer.register_step_pre_hook(functools.partial(swap_in, owner))
    elif next(reversed(hooks)) != handle.id:  # a hook the user registered since: after it
        hooks[handle.id] = hooks.pop(handle.id)
    return True


def swap_in(
    owner: MastersOwner, optimizer: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The optimizer's last step pre-hook: gradients into the masters, the masters into param_groups.

    A step with a closure gets torch's ``(args, kwargs)`` back with a :class:`closure.MasterClosure` in it.
    """
    record = optimizer.__dict__.get(ATTRIBUTE)
    masters = owner.masters
    if masters is None or record.__class__ is not Masters:
        return None
    if masters.step_depth.get(id(optimizer), 0) > 1:  # the outer step copied the gradients; the inner steps the masters
        if not record.swapped:
            record.swap(optimizer, to_masters=True)
        return None
    try:
        step_closure = closure.closure_of(args, kwargs) if len(args) > 1 or kwargs else None
        if step_closure is not None or not record.synced():
            record = gradient_copies.sync(masters, optimizer, record, gradients=step_closure is None)
        elif record.refresh is not None:  # weights written since the gradients were copied (another optimizer)
            gradient_copies.refresh(record)
        if record is not None and record.params:
            if step_closure is not None:
                return closure.begin(
                    optimizer,
                    record,
                    args,
                    kwargs,
                    step_closure,
                    functools.partial(gradient_copies.copy_gradients, masters, record),
                    functools.partial(_give_up, masters, optimizer, record),
                )
            record.swap(optimizer, to_masters=True)
    except Exception as error:  # never the reason a run dies: torch's behaviour from here on
        _give_up(masters, optimizer, record, error)
    return None


def _give_up(masters: MasterWeights, optimizer: Any, record: Masters | None, error: Exception) -> None:
    if isinstance(error, Unwrappable):
        exclude(masters, optimizer, str(error), record)
    else:
        fail(masters, optimizer, record, error)


def after_step(owner: MastersOwner, optimizer: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """Global optimizer step post-hook: the model's lists back, the rounded masters into the parameters."""
    record = getattr(optimizer, "__dict__", {}).get(ATTRIBUTE)
    if record.__class__ is not Masters:
        if record.__class__ is Excluded and record.shares:  # it stepped weights that have masters elsewhere
            for other in record.shares:
                other.refresh = other.refresh or "check"
        return
    masters = owner.masters
    if masters is None or masters.step_depth.get(id(optimizer), 0) > 1:  # (an inner step: its own post-hook
        return  # put the parameters back)
    try:
        if record.swapped:  # else already put back (by a call into this package from an earlier post-hook)
            record.put_back(optimizer)
        record.free_grads(masters)
    except Exception as error:
        fail(masters, optimizer, record, error)


def _after_error(optimizer: Any) -> None:
    record = getattr(optimizer, "__dict__", {}).get(ATTRIBUTE)
    if record.__class__ is Masters and record.swapped:
        try:
            record.put_back(optimizer)
        except Exception as error:  # the step's own exception is the one to see
            logger.debug("ampguard could not put %s back after its step raised: %r", label(optimizer), error)


def _swap_back_in(optimizer: Any) -> None:
    record = getattr(optimizer, "__dict__", {}).get(ATTRIBUTE)
    if record.__class__ is Masters and not record.swapped:
        record.swap(optimizer, to_masters=True)


def put_back_on_error(step: Callable[..., Any], owner: MastersOwner) -> Callable[..., Any]:
    """``step`` (torch's hooked wrapper of an optimizer class's step) that puts the masters back if it raises."""
    if getattr(step, _PUTS_BACK, False):
        return step

    @functools.wraps(step)
    def step_putting_masters_back_on_error(*args: Any, **kwargs: Any) -> Any:
        masters = owner.masters
        if masters is None:  # reverted: torch's step
            return step(*args, **kwargs)
        key = id(args[0]) if args else 0
        depth = masters.step_depth
        depth[key] = depth.get(key, 0) + 1
        try:
            result = step(*args, **kwargs)
            if args and depth[key] > 1:  # a super().step() inside a hooked step: the outer one steps the masters
                _swap_back_in(args[0])
            return result
        except BaseException:
            if args and depth[key] == 1:  # an inner step's error goes on through the outer step, which puts back
                _after_error(args[0])
            raise
        finally:
            if depth[key] == 1:
                del depth[key]
                if masters.removals_after_step and not depth:  # hooks an uninstall removed during the step
                    handles.steps_ended(masters)
            else:
                depth[key] -= 1

    setattr(step_putting_masters_back_on_error, _PUTS_BACK, True)
    return step_putting_masters_back_on_error


def wrap_profile_hook_step(original: Callable[..., Any], owner: MastersOwner) -> Callable[..., Any]:
    """``Optimizer.profile_hook_step``, which torch calls once per optimizer class to hook its step."""

    @functools.wraps(original)
    def profile_hook_step(func: Callable[..., Any]) -> Callable[..., Any]:
        return put_back_on_error(original(func), owner)

    return profile_hook_step


def hooked_classes() -> list[type]:
    """Every optimizer class whose own ``step`` torch has hooked."""
    found: list[type] = []
    stack: list[type] = [torch.optim.Optimizer]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if getattr(vars(cls).get("step"), "hooked", False):
            found.append(cls)
    return found


def unwrap_steps() -> None:
    """Give every optimizer class hooked while ampguard was installed torch's own hooked step back."""
    for cls in hooked_classes():
        step = vars(cls)["step"]
        if getattr(step, _PUTS_BACK, False):
            hooked = step.__wrapped__
            # torch marks the function it assigned (this wrapper, when it hooked the class while ampguard was
            # installed): the mark goes with torch's own, else the next optimizer would hook the class again
            # and every step pre-hook would run twice.
            hooked.hooked = True
            setattr(cls, "step", hooked)  # noqa: B010 (cls is any optimizer class)
