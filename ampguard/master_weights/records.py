"""Which optimizers have masters: the per-optimizer record, built from ``param_groups`` and kept up to date.

An optimizer's ``__dict__`` holds one of: :class:`Masters` (it has
half-precision parameters), :class:`Plain` (it has none: nothing to do while
its groups are unchanged), :class:`Excluded` (ampguard cannot wrap it: left as
torch has it, for good), or, in a copy made by ``copy.deepcopy``/pickle, the
plain dict :func:`pickled` wrote, from which the copy's record is rebuilt.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

import ampguard.master_weights.handles as handles
import ampguard.master_weights.storage as storage
from ampguard.log import event_logger
from ampguard.log import label as label  # re-exported: the name the package and its modules use
from ampguard.master_weights.state_moves import cast_state, earlier_masters, move_state_to_masters

logger = event_logger("masters")

STATE_KEY = "ampguard_master_weights"
ATTRIBUTE = "_ampguard_master_weights"
_POST_HOOK = "_ampguard_master_weights_put_back"
PRE_HOOK = "_ampguard_master_weights_swap_in"  # the handle of step.swap_in, the optimizer's last step pre-hook
_PLAIN_TYPES = (Tensor, torch.nn.Parameter)

KEEPS = "{optimizer} keeps float32 master copies of {counts} ({mib:.1f} MiB)."
CANNOT_WRAP = (
    "{optimizer} holds {dtypes} parameters, but ampguard cannot keep float32 master weights for it: {reason}. "
    "It runs as it would without master weights: its half-precision weights are stepped directly, so small "
    "updates round away (and AdamW can produce NaN in float16). Keep such weights in float32 for training, "
    "or use an optimizer ampguard can wrap (see docs/master-weights.md)."
)
FAILED = "ampguard's master weights failed for {optimizer} ({error}); it is stepped without master weights from now on."


class MasterWeights:
    """The master weights of one application of the patch: which dtypes get masters, the optimizers that have
    them, their float32 memory. The patch holds it (``MasterWeightsPatch.masters``) while applied.

    Example (what the patch's hooks do with it)::

        masters = MasterWeights((torch.float16,))
        record = record_of(masters, optimizer, create=True)  # the optimizer's masters, made at its first step
        masters.retire_all()  # reverted: every optimizer back as torch has it
    """

    def __init__(self, dtypes: tuple[torch.dtype, ...]) -> None:
        self.dtypes = dtypes
        self.memory = storage.MasterMemory()
        self.records: weakref.WeakSet[Masters] = weakref.WeakSet()
        self.synced: weakref.WeakSet[Masters] = weakref.WeakSet()  # gradients copied, step not taken yet
        # a parameter in several optimizers: one float32 gradient for all of their masters (clipped once, seen by all)
        self.shared_grads: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()
        self.wrappers: dict[str, Callable[..., Any]] = {}
        self.excluded: weakref.WeakSet[Any] = weakref.WeakSet()  # optimizers marked Excluded
        # id(optimizer) -> how many of its hooked steps are running (a subclass's step calling super().step()).
        # Above 1, an inner step runs: its hooks leave the masters as they are (the outer step's pre-hook put them in
        # place, and the outer step may have edited their gradients).
        self.step_depth: dict[int, int] = {}
        self.removals_after_step: list[Any] = []  # hook handles an uninstall removed during a step (handles.py)

    def retire_all(self) -> None:
        """Put every optimizer that has masters back as torch would have it (the patch is reverted)."""
        for record in list(self.records):
            optimizer = record.optimizer()
            if optimizer is not None:
                try:
                    retire(self, optimizer, record)
                except Exception as error:
                    logger.warning("ampguard could not put %s back: %r", label(optimizer), error)
        self.records = weakref.WeakSet()
        self.synced = weakref.WeakSet()
        self.excluded = weakref.WeakSet()
        self.shared_grads = weakref.WeakValueDictionary()


class MastersOwner(Protocol):
    """What the hooks and wrappers are built with: the master_weights patch, whose ``masters`` is its current
    application's (None once reverted: torch's behaviour)."""

    masters: MasterWeights | None


class Unwrappable(Exception):
    """Why an optimizer cannot have master weights (the message names the reason)."""


@dataclass
class Plain:
    """An optimizer without trainable half-precision parameters: nothing to do while :func:`quick` is unchanged.

    The per-step check is O(1) (groups added, the last group's list replaced or grown): float32
    optimizers pay a dict lookup and this, about a microsecond, per step.
    """

    signature: tuple[Any, ...]


@dataclass
class Excluded:
    """An optimizer ampguard cannot wrap: left as it is, for good.

    ``shares``: records holding some of its parameters, whose masters must
    take its in-place updates (refreshed after each of its steps).
    """

    reason: str
    shares: weakref.WeakSet[Masters] = field(default_factory=weakref.WeakSet)


@dataclass(eq=False)
class Masters:
    """One optimizer's masters and the bookkeeping of its steps."""

    optimizer: weakref.ref[Any]
    signature: tuple[Any, ...]
    model_lists: list[list[Tensor]]
    master_lists: list[list[Tensor]]
    params: list[Tensor]  # half-precision parameters with a master, in param_groups order
    masters: list[Tensor]
    waiting: list[Tensor]  # half-precision parameters without one (frozen when last looked at)
    master_of: dict[int, Tensor] = field(default_factory=dict)
    shared: set[int] = field(default_factory=set)  # ids of its parameters another optimizer's record holds too
    sync_scaler: Any = None  # weakref to the scaler whose unscale_ copied the gradients
    sync_states: Any = None  # ...and its per-iteration dict at that time (torch's update() replaces it)
    refresh: str | None = None  # "exact": masters from the parameters; "check": only where they disagree
    swapped: bool = False  # param_groups hold the masters: from the step pre-hook to the post-hook
    aliases: tuple[tuple[str, int], ...] = ()  # (optimizer attribute, group) holding a group's list (LBFGS)
    # every master made for this optimizer, by id(param), with a weak reference to its parameter: a parameter
    # frozen or taken out of param_groups and back gets its master again, so the state keyed by it goes on
    earlier: dict[int, tuple[weakref.ref[Tensor], Tensor]] = field(default_factory=dict)

    def synced(self) -> bool:
        """The masters' gradients are this iteration's (copied by a scaler whose iteration is still going on)."""
        scaler = self.sync_scaler() if self.sync_scaler is not None else None
        return scaler is not None and getattr(scaler, "_per_optimizer_states", None) is self.sync_states

    def swap(self, optimizer: Any, to_masters: bool) -> None:
        lists = self.master_lists if to_masters else self.model_lists
        for group, params in zip(optimizer.param_groups, lists):
            group["params"] = params
        for name, index in self.aliases:
            optimizer.__dict__[name] = lists[index]
        self.swapped = to_masters

    def put_back(self, optimizer: Any) -> None:
        """The model's lists into ``param_groups``, the (rounded) masters into the parameters."""
        self.swap(optimizer, to_masters=False)
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.masters)

    def free_grads(self, masters: MasterWeights) -> None:
        for master in self.masters:
            master.grad = None
        self.sync_scaler = self.sync_states = None
        masters.synced.discard(self)


def _signature(optimizer: Any) -> tuple[Any, ...]:
    """Which lists ``param_groups`` hold and which parameters are in them (``group["params"][i] = new`` included).

    Host-side only: a tuple of ids, compared each step (a few microseconds per thousand parameters).
    """
    return tuple((id(group["params"]), tuple(map(id, group["params"]))) for group in optimizer.param_groups)


def quick(optimizer: Any) -> tuple[Any, ...]:
    groups = optimizer.param_groups
    last = groups[-1]["params"] if groups else ()
    return len(groups), id(last), len(last)


def _why_not(masters: MasterWeights, optimizer: Any) -> str | None:
    """Why the hooks and wrappers this package relies on do not reach ``optimizer`` (None: they do)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return "it is not a torch.optim.Optimizer, so torch's step hooks do not reach it"
    cls = type(optimizer)
    if not getattr(cls.step, "hooked", False):
        return "its step() is not wrapped by torch (Optimizer.__init__ was not called), so step hooks do not reach it"
    for name in ("state_dict", "load_state_dict"):
        if masters.wrappers.get(name) is not None and getattr(cls, name) is not masters.wrappers[name]:
            return f"{cls.__name__} defines its own {name}(), so the master weights could not be saved with it"
    return None


def _new_masters(masters: MasterWeights, optimizer: Any, kept: dict[int, Tensor]) -> dict[int, Tensor]:
    """Masters for the trainable half-precision parameters not in ``kept``, the widest first.

    Widest first, so that a Parameter over a slice of another's memory gets a
    view of the other's float32 copy rather than a copy the wider one would straddle.
    """
    found = []
    for index, group in enumerate(optimizer.param_groups):
        for position, param in enumerate(group["params"]):
            if param.dtype in masters.dtypes:
                if type(param) not in _PLAIN_TYPES:
                    raise Unwrappable(f"its parameters are {type(param).__name__} tensors")
                if param.requires_grad and id(param) not in kept:
                    found.append((f"param_groups[{index}]['params'][{position}]", param))
    made = {}
    for where, param in sorted(found, key=lambda item: -item[1].numel()):
        try:
            made[id(param)] = masters.memory.master_for(param)
        except storage.PartialOverlap:
            raise Unwrappable(
                f"its parameter {where} ({str(param.dtype).replace('torch.', '')}, shape {list(param.shape)}) "
                "covers part of the memory of another parameter that has a master, so one float32 copy cannot "
                "serve both"
            ) from None
    return made


def _build(
    masters: MasterWeights,
    optimizer: Any,
    kept: dict[int, Tensor],
    refresh: str | None,
    earlier: dict[int, tuple[weakref.ref[Tensor], Tensor]] | None = None,
) -> Masters | Plain:
    """Scan ``param_groups``: masters for the trainable half-precision parameters (``kept``: id -> master to keep).

    ``earlier``: the masters made before for this optimizer; those of parameters back in
    training are used again (checked against the parameters first: they were not stepped meanwhile).
    """
    signature = _signature(optimizer)
    earlier = dict(earlier or {})
    revived = {key: master for key, master in earlier_masters(optimizer, earlier).items() if key not in kept}
    if revived:
        refresh = refresh or "check"
    kept = {**kept, **revived}
    made = _new_masters(masters, optimizer, kept)
    move_state_to_masters(optimizer, made)
    kept = {**kept, **made}
    model_lists, master_lists, params, copies, waiting = [], [], [], [], []
    for group in optimizer.param_groups:
        group_params = group["params"]
        group_masters = []
        for param in group_params:
            if param.dtype in masters.dtypes:
                if param.requires_grad:
                    master = kept[id(param)]
                    params.append(param)
                    copies.append(master)
                    group_masters.append(master)
                    continue
                waiting.append(param)
            group_masters.append(param)
        model_lists.append(group_params)
        master_lists.append(group_masters)
    if not params and not waiting:
        return Plain(quick(optimizer))
    record = Masters(weakref.ref(optimizer), signature, model_lists, master_lists, params, copies, waiting)
    record.master_of = {id(p): m for p, m in zip(params, copies)}
    earlier = {key: made for key, made in earlier.items() if made[0]() is not None}
    earlier.update((id(p), (weakref.ref(p), m)) for p, m in zip(params, copies))
    record.earlier = earlier
    record.refresh = refresh
    return record


def pickled(optimizer: Any, record: Masters) -> dict[str, Any]:
    """What ``copy.deepcopy``/pickle carry of ``record``: which master is whose, and the masters' float32 state.

    The copy's own ``state`` is keyed by the parameters and cast to their
    dtype, as torch would have it (a copy loaded without ampguard steps with
    it); :func:`record_of` puts the float32 state back under the masters.
    """
    pairs = list(zip(record.params, record.masters))
    return {"pairs": pairs, "refresh": record.refresh, "state": [optimizer.state.get(m) for _, m in pairs]}


def record_of(masters: MasterWeights, optimizer: Any, *, create: bool, rebuild: bool = False) -> Masters | None:
    """The optimizer's masters, (re)built when ``create`` and its param_groups changed; None: nothing to do.

    A record still ``swapped`` outside a step belongs to a step that raised
    (the post-hook never ran): it is put back first, as torch's in-place step
    would have left the optimizer.
    """
    entry = getattr(optimizer, "__dict__", {}).get(ATTRIBUTE)
    if entry.__class__ is Masters and entry.swapped:
        entry.put_back(optimizer)
    if isinstance(entry, Excluded):
        return None
    if isinstance(entry, Plain) and (not create or entry.signature == quick(optimizer)):
        return None
    if isinstance(entry, Masters) and (not create or (entry.signature == _signature(optimizer) and not rebuild)):
        return entry
    unpickled = isinstance(entry, dict) and "pairs" in entry
    if not create and not unpickled:
        return None
    previous = entry if isinstance(entry, Masters) else None
    try:
        reason = _why_not(masters, optimizer)
        if reason is not None:
            raise Unwrappable(reason)
        if unpickled:
            assert isinstance(entry, dict)
            pairs = [(param, masters.memory.adopt(param, master)) for param, master in entry["pairs"]]
            for (param, master), saved in zip(pairs, entry["state"]):
                optimizer.state.pop(param, None)  # the copy torch would have had: the float32 one goes in its place
                if saved is not None:
                    optimizer.state[master] = saved
            built = _build(masters, optimizer, {id(p): m for p, m in pairs}, entry["refresh"])
        else:
            built = (
                _build(masters, optimizer, previous.master_of, previous.refresh, previous.earlier)
                if previous is not None
                else _build(masters, optimizer, {}, None)
            )
    except Unwrappable as why:
        exclude(masters, optimizer, str(why), previous)
        return None
    optimizer.__dict__[ATTRIBUTE] = built
    if not isinstance(built, Masters):
        return None
    _put_back_before_its_own_post_hooks(masters, optimizer)
    if previous is not None:
        masters.records.discard(previous)
    for other in masters.records:
        common = built.master_of.keys() & other.master_of.keys()
        other.shared |= common
        built.shared |= common
        for key in common:  # a gradient the other optimizer holds already is the one to share
            grad = other.master_of[key].grad
            if grad is not None:
                masters.shared_grads[key] = grad
    masters.records.add(built)
    for other in list(masters.excluded):
        _note_sharing(masters, other)
    if (previous is None or not previous.params) and not unpickled:
        _announce(optimizer, built)
    return built


def _put_back_before_its_own_post_hooks(masters: MasterWeights, optimizer: Any) -> None:
    """torch runs an optimizer's own step post-hooks before the global one: put the parameters back first for them."""
    if _POST_HOOK in optimizer.__dict__:
        return
    try:
        handle = optimizer.register_step_post_hook(functools.partial(_put_back, masters))
        optimizer._optimizer_step_post_hooks.move_to_end(handle.id, last=False)
    except (AttributeError, KeyError):  # the global post-hook puts them back, after the optimizer's own hooks
        return
    optimizer.__dict__[_POST_HOOK] = handle


def _put_back(masters: MasterWeights, optimizer: Any, args: Any, kwargs: Any) -> None:
    record = optimizer.__dict__.get(ATTRIBUTE)
    if record.__class__ is Masters and record.swapped:  # (inside a super().step() too: the outer swaps back in)
        try:
            record.put_back(optimizer)
        except Exception as error:  # never the reason a run dies: torch's behaviour from here on
            fail(masters, optimizer, record, error)


def _announce(optimizer: Any, record: Masters) -> None:
    if not record.params or not logger.isEnabledFor(logging.INFO):
        return
    tensors: dict[torch.dtype, int] = {}
    numel: dict[torch.dtype, int] = {}
    for param in record.params:
        tensors[param.dtype] = tensors.get(param.dtype, 0) + 1
        numel[param.dtype] = numel.get(param.dtype, 0) + param.numel()
    counts = " and ".join(
        f"{tensors[dtype]:,} {str(dtype).replace('torch.', '')} parameter tensor{'s' if tensors[dtype] != 1 else ''} "
        f"with {n:,} value{'s' if n != 1 else ''}"
        for dtype, n in numel.items()
    )
    logger.info(KEEPS.format(optimizer=label(optimizer), counts=counts, mib=sum(numel.values()) * 4 / 2**20))


def _half_dtypes(masters: MasterWeights, optimizer: Any) -> list[str]:
    found = {
        str(p.dtype).replace("torch.", "")
        for group in getattr(optimizer, "param_groups", ())
        for p in group["params"]
        if p.dtype in masters.dtypes and p.requires_grad
    }
    return sorted(found)


def _mark_excluded(masters: MasterWeights, optimizer: Any, reason: str) -> None:
    try:
        optimizer.__dict__[ATTRIBUTE] = Excluded(reason)
        masters.excluded.add(optimizer)
    except (AttributeError, TypeError):  # not an object we can mark: say it every time it comes back
        return
    _note_sharing(masters, optimizer)


def _note_sharing(masters: MasterWeights, optimizer: Any) -> None:
    """The records that hold parameters of the excluded ``optimizer`` (its steps write into their masters' weights)."""
    entry = optimizer.__dict__.get(ATTRIBUTE)
    if not isinstance(entry, Excluded):
        return
    ids = {id(p) for group in optimizer.param_groups for p in group["params"] if p.dtype in masters.dtypes}
    for record in masters.records:
        if not ids.isdisjoint(record.master_of):
            entry.shares.add(record)


def exclude(masters: MasterWeights, optimizer: Any, reason: str, record: Masters | None) -> None:
    """Leave ``optimizer`` as torch has it, for good (putting its state back on its parameters), and say so once."""
    if record is not None:
        retire(masters, optimizer, record)
    dtypes = _half_dtypes(masters, optimizer)
    _mark_excluded(masters, optimizer, reason)
    if dtypes:
        logger.warning(CANNOT_WRAP.format(optimizer=label(optimizer), dtypes=" and ".join(dtypes), reason=reason))


def retire(masters: MasterWeights, optimizer: Any, record: Masters) -> None:
    """Put the optimizer back as torch would have it: state keyed by the parameters (cast to their dtype)."""
    record.put_back(optimizer)
    for param, master in zip(record.params, record.masters):
        if master in optimizer.state:
            optimizer.state[param] = cast_state(optimizer.state.pop(master), param.dtype)
    if record.synced():  # unscaled (maybe clipped) by the scaler since: the step torch takes next must use them
        with torch.no_grad():
            for param, master in zip(record.params, record.masters):
                if master.grad is not None and param.grad is not None:
                    param.grad.copy_(master.grad)
    record.free_grads(masters)
    masters.records.discard(record)
    optimizer.__dict__.pop(ATTRIBUTE, None)
    for key in (_POST_HOOK, PRE_HOOK):
        handle = optimizer.__dict__.pop(key, None)
        if handle is not None:
            handles.remove_hook(masters, handle)


def fail(masters: MasterWeights, optimizer: Any, record: Masters | None, error: Exception) -> None:
    logger.warning(FAILED.format(optimizer=label(optimizer), error=f"{type(error).__name__}: {error}"))
    try:
        if record is not None:
            retire(masters, optimizer, record)
        _mark_excluded(masters, optimizer, f"failed: {error!r}")
    except Exception as second:
        logger.debug("ampguard could not put %s back: %r", label(optimizer), second)
