"""fp32 master weights for half-precision parameters: which tensors hold the gradients, the copies, the state.

A model loaded in float16 (``torch_dtype=torch.float16``, ``model.half()``)
cannot be trained by stepping its float16 weights: AdamW's ``eps`` and second
moment underflow (NaN after one step) and SGD's small updates round away.
apex O2, DeepSpeed, Megatron and fairseq keep a float32 "master" copy of each
such weight; this module does it for any ``torch.optim.Optimizer``.

The mechanism (apex O2's swap, but only for the length of each step):

* **Which parameters.** At an optimizer's first ``unscale_``, ``step`` or
  ``load_state_dict``, every trainable (``requires_grad``) float16 parameter in
  its ``param_groups`` (bfloat16 too with ``AMPGUARD_MASTER_WEIGHTS=all``) gets
  a float32 master. Frozen ones never do (a LoRA fine-tune pays for its
  adapters only); one that starts receiving gradients later gets its master
  then. float32 parameters are left alone: an optimizer without half-precision
  parameters is not touched at all.
* **What the user holds is unchanged.** Between steps ``param_groups`` hold the
  model's own parameters (schedulers, ``add_param_group``, ``zero_grad``,
  trainers see what they built); ``optimizer.state`` is keyed by the masters and
  is float32.
* **Gradients.** The half-precision gradient is copied into ``master.grad``
  (float32): by the GradScaler's ``unscale_``, which then unscales and checks
  it there, or, without a scaler, just before the step. From that copy until
  the step, :func:`gradients` / :func:`gradient_pairs` answer "which tensor
  holds this parameter's gradient" for the scaler, ``clip_grad_norm_`` and the
  skipped-step report. ``p.grad`` itself keeps the value backward left there.
* **The step.** A global optimizer step pre-hook puts the master lists into
  ``param_groups``; the optimizer steps the masters; the post-hook puts the
  model's lists back, copies the rounded masters into the parameters (one
  foreach copy: the parameters keep their dtype, so forward and its memory are
  unchanged) and frees the master gradients.
* **Checkpoints.** ``Optimizer.state_dict`` / ``load_state_dict`` (wrapped on
  the base class) see the masters as the parameters, so the state is saved and
  loaded in float32, and the masters travel under the extra key
  :data:`STATE_KEY` (plain torch ignores it). A checkpoint without it rebuilds
  the masters from the parameters at the next step.

Optimizers ampguard cannot wrap (not a hooked ``torch.optim.Optimizer``, own
``state_dict``, tensor-subclass parameters, sparse gradients, a closure) get
one message and run as they do without master weights.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ampguard.log import event_logger

logger = event_logger("masters")

STATE_KEY = "ampguard_master_weights"
_ATTRIBUTE = "_ampguard_master_weights"
_PLAIN_TYPES = (Tensor, torch.nn.Parameter)

KEEPS = "{optimizer} keeps float32 master copies of {counts} ({mib:.1f} MiB)."
CANNOT_WRAP = (
    "{optimizer} holds {dtypes} parameters, but ampguard cannot keep float32 master weights for it: {reason}. "
    "It runs as it would without master weights: its half-precision weights are stepped directly, so small "
    "updates round away (and AdamW can produce NaN in float16). Keep such weights in float32 for training, "
    "or use an optimizer ampguard can wrap (see docs/master-weights.md)."
)
FAILED = "ampguard's master weights failed for {optimizer} ({error}); it is stepped without master weights from now on."


class _State:
    def __init__(self) -> None:
        self.active = False
        self.dtypes: tuple[torch.dtype, ...] = ()
        self.records: weakref.WeakSet[_Masters] = weakref.WeakSet()
        self.synced: weakref.WeakSet[_Masters] = weakref.WeakSet()  # gradients copied, step not taken yet
        self.wrappers: dict[str, Callable[..., Any]] = {}


state = _State()


def label(optimizer: Any) -> str:
    return f"{type(optimizer).__name__}#{id(optimizer) & 0xFFFF:04x}"


class _Unwrappable(Exception):
    """Why an optimizer cannot have master weights (the message names the reason)."""


@dataclass
class _Plain:
    """An optimizer without trainable half-precision parameters: nothing to do while :func:`_quick` is unchanged.

    The per-step check is O(1) (groups added, the last group's list replaced or grown): float32
    optimizers pay a dict lookup and this, about a microsecond, per step.
    """

    signature: tuple[Any, ...]


@dataclass
class _Excluded:
    """An optimizer ampguard cannot wrap: left as it is, for good."""

    reason: str


@dataclass(eq=False)
class _Masters:
    """One optimizer's masters and the bookkeeping of its steps."""

    optimizer: weakref.ref[Any]
    signature: tuple[Any, ...]
    model_lists: list[list[Tensor]]
    master_lists: list[list[Tensor]]
    params: list[Tensor]  # half-precision parameters with a master, in param_groups order
    masters: list[Tensor]
    waiting: list[Tensor]  # half-precision parameters without one (frozen when last looked at)
    master_of: dict[int, Tensor] = field(default_factory=dict)
    sync_scaler: Any = None  # weakref to the scaler whose unscale_ copied the gradients
    sync_states: Any = None  # ...and its per-iteration dict at that time (torch's update() replaces it)
    refresh: str | None = None  # "exact": masters from the parameters; "check": only where they disagree
    swapped: bool = False

    def synced(self) -> bool:
        """The masters' gradients are this iteration's (copied by a scaler whose iteration is still going on)."""
        scaler = self.sync_scaler() if self.sync_scaler is not None else None
        return scaler is not None and getattr(scaler, "_per_optimizer_states", None) is self.sync_states

    def swap(self, optimizer: Any, to_masters: bool) -> None:
        lists = self.master_lists if to_masters else self.model_lists
        for group, params in zip(optimizer.param_groups, lists):
            group["params"] = params
        self.swapped = to_masters

    def free_grads(self) -> None:
        for master in self.masters:
            master.grad = None
        self.sync_scaler = self.sync_states = None
        state.synced.discard(self)


def _signature(optimizer: Any) -> tuple[Any, ...]:
    return tuple((id(group["params"]), len(group["params"])) for group in optimizer.param_groups)


def _quick(optimizer: Any) -> tuple[Any, ...]:
    groups = optimizer.param_groups
    last = groups[-1]["params"] if groups else ()
    return len(groups), id(last), len(last)


def _why_not(optimizer: Any) -> str | None:
    """Why the hooks and wrappers this module relies on do not reach ``optimizer`` (None: they do)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return "it is not a torch.optim.Optimizer, so torch's step hooks do not reach it"
    cls = type(optimizer)
    if not getattr(cls.step, "hooked", False):
        return "its step() is not wrapped by torch (Optimizer.__init__ was not called), so step hooks do not reach it"
    for name in ("state_dict", "load_state_dict"):
        if state.wrappers.get(name) is not None and getattr(cls, name) is not state.wrappers[name]:
            return f"{cls.__name__} defines its own {name}(), so the master weights could not be saved with it"
    return None


def _build(optimizer: Any, previous: _Masters | None) -> _Masters | _Plain:
    """Scan ``param_groups``: masters for the trainable half-precision parameters (kept from ``previous``)."""
    signature = _signature(optimizer)
    kept = previous.master_of if previous is not None else {}
    model_lists, master_lists, params, masters, waiting = [], [], [], [], []
    for group in optimizer.param_groups:
        group_params = group["params"]
        group_masters = []
        for param in group_params:
            if param.dtype in state.dtypes:
                if type(param) not in _PLAIN_TYPES:
                    raise _Unwrappable(f"its parameters are {type(param).__name__} tensors")
                if param.requires_grad:
                    master = kept.get(id(param))
                    if master is None:
                        master = torch.nn.Parameter(param.detach().to(torch.float32, copy=True))
                    params.append(param)
                    masters.append(master)
                    group_masters.append(master)
                    continue
                waiting.append(param)
            group_masters.append(param)
        model_lists.append(group_params)
        master_lists.append(group_masters)
    if not params and not waiting:
        return _Plain(_quick(optimizer))
    record = _Masters(weakref.ref(optimizer), signature, model_lists, master_lists, params, masters, waiting)
    record.master_of = {id(p): m for p, m in zip(params, masters)}
    if previous is not None:
        record.refresh = previous.refresh
    return record


def _record(optimizer: Any, *, create: bool, rebuild: bool = False) -> _Masters | None:
    """The optimizer's masters, (re)built when ``create`` and its param_groups changed; None: nothing to do."""
    entry = getattr(optimizer, "__dict__", {}).get(_ATTRIBUTE)
    if isinstance(entry, _Excluded):
        return None
    if isinstance(entry, _Plain) and (not create or entry.signature == _quick(optimizer)):
        return None
    if isinstance(entry, _Masters) and (not create or (entry.signature == _signature(optimizer) and not rebuild)):
        return entry
    if not create:
        return None
    previous = entry if isinstance(entry, _Masters) else None
    try:
        reason = _why_not(optimizer)
        if reason is not None:
            raise _Unwrappable(reason)
        built = _build(optimizer, previous)
    except _Unwrappable as why:
        _exclude(optimizer, str(why), previous)
        return None
    optimizer.__dict__[_ATTRIBUTE] = built
    if not isinstance(built, _Masters):
        return None
    _move_eager_state(optimizer, built)
    state.records.add(built)
    if previous is not None:
        state.records.discard(previous)
    if previous is None or not previous.params:
        _announce(optimizer, built)
    return built


def _move_eager_state(optimizer: Any, record: _Masters) -> None:
    """State an optimizer made for a parameter before it had a master (Adagrad's ``sum``, made in
    ``__init__``) goes to the master, in float32: left on the parameter it would be stepped past and
    break ``state_dict()`` (a key that is no parameter of ``param_groups``)."""
    for param, master in zip(record.params, record.masters):
        if param in optimizer.state and master not in optimizer.state:
            optimizer.state[master] = {
                key: value.to(torch.float32)
                if key != "step" and torch.is_tensor(value) and value.is_floating_point()
                else value
                for key, value in optimizer.state.pop(param).items()
            }


def _announce(optimizer: Any, record: _Masters) -> None:
    if not record.params or not logger.isEnabledFor(logging.INFO):
        return
    numel: dict[torch.dtype, int] = {}
    for param in record.params:
        numel[param.dtype] = numel.get(param.dtype, 0) + param.numel()
    counts = " and ".join(f"{n:,} {str(dtype).replace('torch.', '')}" for dtype, n in numel.items()) + " parameters"
    logger.info(KEEPS.format(optimizer=label(optimizer), counts=counts, mib=sum(numel.values()) * 4 / 2**20))


def _half_dtypes(optimizer: Any) -> list[str]:
    found = {
        str(p.dtype).replace("torch.", "")
        for group in getattr(optimizer, "param_groups", ())
        for p in group["params"]
        if p.dtype in state.dtypes and p.requires_grad
    }
    return sorted(found)


def _exclude(optimizer: Any, reason: str, record: _Masters | None) -> None:
    """Leave ``optimizer`` as torch has it, for good (putting its state back on its parameters), and say so once."""
    if record is not None:
        _retire(optimizer, record)
    dtypes = _half_dtypes(optimizer)
    try:
        optimizer.__dict__[_ATTRIBUTE] = _Excluded(reason)
    except (AttributeError, TypeError):  # not an object we can mark: say it every time it comes back
        pass
    if dtypes:
        logger.warning(CANNOT_WRAP.format(optimizer=label(optimizer), dtypes=" and ".join(dtypes), reason=reason))


def _retire(optimizer: Any, record: _Masters) -> None:
    """Put the optimizer back as torch would have it: state keyed by the parameters (cast to their dtype)."""
    record.swap(optimizer, to_masters=False)
    with torch.no_grad():
        for param, master in zip(record.params, record.masters):
            param.copy_(master)
            if master in optimizer.state:
                optimizer.state[param] = {
                    key: value.to(param.dtype)
                    if key != "step" and torch.is_tensor(value) and value.is_floating_point()
                    else value
                    for key, value in optimizer.state.pop(master).items()
                }
    record.free_grads()
    state.records.discard(record)
    optimizer.__dict__.pop(_ATTRIBUTE, None)


# -- gradients ------------------------------------------------------------------------


def _sync(optimizer: Any, record: _Masters) -> _Masters | None:
    """Copy the half-precision gradients into the masters' (float32) ``.grad``; the record in use, or None."""
    if any(p.grad is not None for p in record.waiting):  # a frozen parameter started training: its master now
        rebuilt = _record(optimizer, create=True, rebuild=True)
        if rebuilt is None:  # excluded on the way (and said so)
            return None
        record = rebuilt
    with torch.no_grad():
        if record.refresh is not None:
            _refresh(record)
        sources, targets = [], []
        for param, master in zip(record.params, record.masters):
            grad = param.grad
            if grad is None:
                master.grad = None
                continue
            if grad.layout is not torch.strided:
                raise _Unwrappable("it receives sparse gradients")
            if master.grad is None:
                master.grad = torch.empty_like(master)
            sources.append(grad)
            targets.append(master.grad)
        if sources:
            torch._foreach_copy_(targets, sources)
    return record


def _refresh(record: _Masters) -> None:
    """After a load: masters from the parameters ("exact"), or only where they no longer round to them ("check")."""
    if record.refresh == "exact":
        torch._foreach_copy_(record.masters, record.params)
    else:  # keep the loaded float32 value wherever it still rounds to the parameter: no host read
        for param, master in zip(record.params, record.masters):
            master.copy_(torch.where(master.to(param.dtype) == param, master, param.to(master.dtype)))
    record.refresh = None


def gradients(optimizer: Any, scaler: Any = None) -> list[tuple[Tensor, Tensor | None]]:
    """``(parameter, the tensor holding its gradient)`` for every parameter of ``optimizer``, in param_groups order.

    With ``scaler`` (called from its ``unscale_``), the half-precision gradients
    are first copied into the float32 masters, which the scaler then unscales.
    """
    record = None
    try:
        record = _record(optimizer, create=scaler is not None) if state.active else None
        if record is not None and scaler is not None:
            record = _sync(optimizer, record)
            if record is not None:
                record.sync_scaler, record.sync_states = weakref.ref(scaler), scaler._per_optimizer_states
                state.synced.add(record)
    except _Unwrappable as why:
        _exclude(optimizer, str(why), record)
        record = None
    except Exception as error:  # never the reason a run dies: the scaler unscales the parameters' gradients
        _fail(optimizer, record, error)
        record = None
    if record is None or not record.synced():
        return [(p, p.grad) for group in optimizer.param_groups for p in group["params"]]
    master_of = record.master_of
    return [
        (p, master_of[id(p)].grad if id(p) in master_of else p.grad)
        for group in optimizer.param_groups
        for p in group["params"]
    ]


def gradient_pairs(params: Iterable[Tensor]) -> list[tuple[Tensor, Tensor]]:
    """``(parameter, gradient)`` for each of ``params`` with a gradient: the master's when it holds this iteration's."""
    lookup: dict[int, Tensor] = {}
    for record in list(state.synced):
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


def masters_of(optimizer: Any) -> list[tuple[Tensor, Tensor]]:
    """``(parameter, master)`` pairs of ``optimizer`` (empty when it has none)."""
    record = _record(optimizer, create=False)
    return list(zip(record.params, record.masters)) if record is not None else []


# -- the step -------------------------------------------------------------------------


def _has_closure(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    return (len(args) > 1 and args[1] is not None) or kwargs.get("closure") is not None


def before_step(optimizer: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """Global optimizer step pre-hook: gradients into the masters, the masters into param_groups."""
    if not state.active:
        return
    entry = optimizer.__dict__.get(_ATTRIBUTE)
    if entry.__class__ is _Plain and entry.signature == _quick(optimizer):
        return  # the float32 optimizer's path
    record = None
    try:
        record = _record(optimizer, create=True)
        if record is None:
            return
        if _has_closure(args, kwargs):
            raise _Unwrappable("its step() is called with a closure, which re-runs backward inside the step")
        if not record.synced():
            record = _sync(optimizer, record)
        if record is not None and record.params:
            record.swap(optimizer, to_masters=True)
    except _Unwrappable as why:
        _exclude(optimizer, str(why), record)
    except Exception as error:  # never the reason a run dies: torch's behaviour from here on
        _fail(optimizer, record, error)


def after_step(optimizer: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """Global optimizer step post-hook: the model's lists back, the rounded masters into the parameters."""
    record = getattr(optimizer, "__dict__", {}).get(_ATTRIBUTE)
    if not isinstance(record, _Masters) or not record.swapped:
        return
    try:
        record.swap(optimizer, to_masters=False)
        with torch.no_grad():
            torch._foreach_copy_(record.params, record.masters)
        record.free_grads()
    except Exception as error:
        _fail(optimizer, record, error)


def _fail(optimizer: Any, record: _Masters | None, error: Exception) -> None:
    logger.warning(FAILED.format(optimizer=label(optimizer), error=f"{type(error).__name__}: {error}"))
    try:
        if record is not None:
            _retire(optimizer, record)
        optimizer.__dict__[_ATTRIBUTE] = _Excluded(f"failed: {error!r}")
    except Exception as second:
        logger.debug("ampguard could not put %s back: %r", label(optimizer), second)


# -- checkpoints and zero_grad (wrappers of the torch.optim.Optimizer methods) -----------


def _current(optimizer: Any) -> _Masters | None:
    if not state.active:
        return None
    entry = getattr(optimizer, "__dict__", {}).get(_ATTRIBUTE)
    return _record(optimizer, create=isinstance(entry, _Masters))


def wrap_state_dict(original: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    @functools.wraps(original)
    def state_dict(self: Any) -> dict[str, Any]:
        record = _current(self)
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

    state.wrappers["state_dict"] = state_dict
    return state_dict


def wrap_load_state_dict(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def load_state_dict(self: Any, state_dict: dict[str, Any]) -> None:
        try:
            record = _record(self, create=True) if state.active else None
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

    state.wrappers["load_state_dict"] = load_state_dict
    return load_state_dict


def wrap_zero_grad(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def zero_grad(self: Any, *args: Any, **kwargs: Any) -> None:
        record = getattr(self, "__dict__", {}).get(_ATTRIBUTE)
        if isinstance(record, _Masters):
            record.free_grads()
        return original(self, *args, **kwargs)

    state.wrappers["zero_grad"] = zero_grad
    return zero_grad


# -- switching on and off -------------------------------------------------------------


def activate(dtypes: tuple[torch.dtype, ...]) -> None:
    state.dtypes = dtypes
    state.active = True


def deactivate() -> None:
    """Switch off, putting every optimizer that has masters back as torch would have it."""
    state.active = False
    for record in list(state.records):
        optimizer = record.optimizer()
        if optimizer is not None:
            try:
                _retire(optimizer, record)
            except Exception as error:
                logger.warning("ampguard could not put %s back: %r", label(optimizer), error)
    state.records = weakref.WeakSet()
    state.synced = weakref.WeakSet()
    state.wrappers = {}
