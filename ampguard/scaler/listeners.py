"""The capabilities that react to a SafeGradScaler's steps: registered by their patches, imported by no scaler module.

A capability (fp32 islands, the LR scheduler hold, ...) subclasses
:class:`StepListener`, overrides what it needs, and its patch registers an
instance with :func:`add` in ``apply()`` and :func:`remove` in ``revert()``.
The scaler calls every registered listener at fixed points of an iteration, each time with the scaler's
:class:`~ampguard.scaler.handle.ScalerHandle` (never the scaler itself):

======================  ======================================================================
``on_scale``             ``scale()``: the scaled loss (while subscribed to ``"scale"``)
``on_unscale``           ``unscale_()`` or a fused ``step()``: gradients still scaled (while subscribed to ``"unscale"``)
``add_to_read``          ``step()``, before torch's one host read: the listener's field of the packed value
                         (while subscribed to ``"read"``)
``on_read``              ``step()``, after that read: the optimizer was stepped, or skipped
``on_update``            ``update()`` in host mode: the iteration's :class:`~ampguard.scaler.verdict.StepVerdict`,
                         when it overflowed, changed the scale, or the step reached the listener's ``wake_at``
``on_device_update``     ``update()`` in device mode (fused optimizers): nothing is known on the host
``on_counters_read``     device-mode iterations became known (their rows' host copies, or the ledger's read)
``on_step_pending``      ``update()`` in device mode: a fused optimizer's step was made, its verdict still on the device
``on_step_known``        a fused optimizer's step, stepped or skipped on the device, became known (at once on the CPU)
``on_foreign_step``      a step of a loss scale that is no SafeGradScaler (DeepSpeed's fp16 scale) ended
``stats_fields``         ``scaler.stats``: the fields of ScalerStats the listener fills
``save`` / ``load``      entries of ``scaler.state_dict()["ampguard"]``, also carried by pickles and deep copies
======================  ======================================================================

**The packed read.** torch's ``step()`` reads one number, found_inf, on the
host. The scaler makes that number carry more (:func:`encode`): bit 0 is
found_inf, bit 1 "a loss was inf/NaN", and the listeners own the bits above,
``read_bits`` each, in registration order. It is a float32 on the device,
exact up to 2**24, so the listeners' fields share :data:`FIELD_BITS` bits.

**What a healthy step costs.** Subscriptions are data the listener keeps up
to date, so that the scaler calls nobody on a healthy step that concerns
nobody: ``scale``, ``unscale`` and ``read`` reach the listeners subscribed to
them (:func:`subscribe`, :func:`unsubscribe`: a sampler armed, a probe
watching); ``on_update`` reaches a listener when the iteration overflowed or
changed the scale, or when that scaler's optimizer steps reach the listener's
``wake_at[id(handle)]`` (none there: every update), which the listener keeps
itself (and drops with the handle, whose life is the scaler's).

**What a listener holds.** The handle, in weak structures only (it keys the
listener's per-scaler state: ``weakref.WeakKeyDictionary``, ``weakref.finalize``,
``id()``); it reads the scaler through ``handle.view()`` and ``handle.steps``
and asks for a change through ``handle.grow_now()`` and ``handle.skip_step_if()``:
never the scaler's attributes, never the scaler.
A listener that raises is reported once (:mod:`ampguard.containment`) and the
step goes on as torch's.

**Where gradients are held.** A capability that keeps parameters' gradients
elsewhere for the step (master weights: the float32 masters' ``.grad``) says
so with :func:`hold_gradients`; the scaler's ``unscale_`` and the clip ask
:data:`gradient_holders` (:func:`gradients`, :func:`gradient_pairs` elsewhere),
so the scaler imports no capability.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

import ampguard.containment as containment

if TYPE_CHECKING:
    from ampguard.scaler.handle import ScalerHandle
    from ampguard.scaler.verdict import StepVerdict

FOUND = 1  # bit 0: the optimizer's found_inf
LOSS_NONFINITE = 2  # bit 1: a loss of the iteration was inf/NaN
FIRST_FIELD_BIT = 2
FIELDS_START = 1 << FIRST_FIELD_BIT  # the values that carry a field
FIELD_BITS = 22  # 2 + 22 = 24: the integers a float32 holds exactly


class StepListener:
    """What a capability hears from the scaler. Every method is optional; the defaults do nothing.

    ``handle``, the first argument of each (but :meth:`on_foreign_step`): the scaler's
    :class:`~ampguard.scaler.handle.ScalerHandle`, the key for the listener's state of that scaler.
    """

    name = "listener"  # in reports of its failures
    read_bits = 0  # the bits of the packed host read this listener owns

    def __init__(self) -> None:
        # id(handle) -> the optimizer steps (``handle.steps``) from which a healthy update of that handle's scaler
        # concerns this listener; a handle not in it: every update (an overflow or a change of scale always).
        self.wake_at: dict[int, int] = {}

    def on_scale(self, handle: ScalerHandle, scaled: Any) -> None:
        """``scale()`` returns ``scaled`` (a tensor, or torch's container of them): the loss whose backward pass the
        scale is for. Called on every ``scale()``: keep it to a few comparisons on a step it does not concern."""

    def on_unscale(self, handle: ScalerHandle, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer``'s gradients are about to be unscaled (``unscale_()``, or a fused optimizer's ``step()``):
        they still hold the scaled values of the backward passes. Called on every such call: keep it to a few
        comparisons on a step it does not concern."""

    def add_to_read(self, handle: ScalerHandle, code: torch.Tensor, shift: int) -> torch.Tensor:
        """``code`` plus this listener's field ``<< shift`` (on the device, below ``2**read_bits``)."""
        return code

    def on_read(self, handle: ScalerHandle, optimizer: torch.optim.Optimizer, field: int, skipped: bool) -> None:
        """After the read in ``step()``: ``optimizer`` was skipped, or stepped; ``field`` is this listener's."""

    def on_update(self, handle: ScalerHandle, verdict: StepVerdict, field: int) -> None:
        """The end of a host-mode ``update()`` that concerns this listener (see ``wake_at``).

        ``verdict.forward_overflow``: a step was skipped because a loss itself was
        inf/NaN (agreed between ranks). ``field``: the largest this listener's
        field was in the iteration's reads (on any rank).
        """

    def on_device_update(
        self, handle: ScalerHandle, check: torch.Tensor | None, held: bool, row: torch.Tensor | None
    ) -> bool | None:
        """The end of a device-mode ``update()``: nothing was read on the host.

        ``check``: the iteration's loss check on the device (NaN when a loss was
        inf/NaN; None: no optimizer step). ``held``: a non-finite loss keeps the
        scale (no back-off). ``row``: the iteration's ledger row,
        ``[skipped, found, check, scale]``. Returns whether a step was skipped
        when the listener read it (None: not read).
        """
        return None

    def on_counters_read(
        self, handle: ScalerHandle, forward_overflows: int, iterations: int, at_read: bool, current: bool
    ) -> None:
        """The host learned the verdicts of ``iterations`` more device-mode iterations.

        ``forward_overflows`` of them were forward overflows: a loss itself was
        inf/NaN and the step was skipped (a non-finite loss with finite
        gradients steps, as in host mode's :meth:`on_update`). Each iteration is
        told once: from its row's host copy as soon as it is complete
        (:class:`ampguard.scaler.ledger.RowCopies`; ``at_read`` False, at most once per
        ``update()``), or at the ledger's read (``at_read`` True). ``current``:
        they end with the iteration just updated (always at a read; on the CPU
        for the copies too).
        """

    def on_step_pending(self, handle: ScalerHandle, optimizer: torch.optim.Optimizer) -> None:
        """A fused ``optimizer``'s step was made in the iteration just updated; :meth:`on_step_known` tells its
        verdict later (at this same update on the CPU), once, in step order."""

    def on_step_known(self, handle: ScalerHandle, optimizer: torch.optim.Optimizer, skipped: bool) -> None:
        """A fused ``optimizer``'s step (no host read told of it) is known: stepped, or skipped on the device.

        In step order; at the step's own ``update()`` on the CPU, an iteration or
        two later on CUDA (:class:`ampguard.scaler.ledger.RowCopies`).
        """

    def on_overflow_known(self, handle: ScalerHandle, scale: float) -> None:
        """A device-mode iteration's gradients overflowed at loss ``scale`` (not a forward overflow): learned from
        its row, once, when the host learns it (``DeviceBooks._tell_known_rows``, or the ledger's
        read)."""

    def on_foreign_step(self, owner: Any, forward_overflow: bool) -> None:
        """An optimizer step of a loss scale that is no SafeGradScaler ended (:mod:`ampguard.deepspeed_fp16`).

        ``owner``: that scale's counts (``owner.steps``: the steps so far, this one included).
        ``forward_overflow``: the step was skipped because a loss itself was inf/NaN (agreed between ranks).
        No listener field rides on a read there: a listener reads what it needs, at a forward overflow only.
        """

    def stats_fields(self, handle: ScalerHandle) -> dict[str, Any]:
        """Fields of :class:`~ampguard.stats.counters.ScalerStats` this listener fills for ``handle``'s scaler."""
        return {}

    def save(self, handle: ScalerHandle | Any) -> dict[str, Any]:
        """Entries for ``scaler.state_dict()["ampguard"]`` and the scaler's pickle (plain data: Python numbers,
        strings, lists and dicts, which a ``weights_only=True`` load takes). ``handle``: that scaler's; or, for
        a DeepSpeed fp16 optimizer's state (:mod:`ampguard.deepspeed_fp16.checkpoint`), the counts of its loss
        scale, the ``owner`` of :meth:`on_foreign_step`."""
        return {}

    def load(self, handle: ScalerHandle | Any, entries: dict[str, Any]) -> None:
        """The ``ampguard`` entries of a state loaded into ``handle``'s scaler (``load_state_dict()``, unpickling,
        a deep copy: the copy's own handle); perhaps an older version's, perhaps without yours. ``handle``: as
        for :meth:`save`."""


_listeners: list[StepListener] = []

# (listener, shift) for each listener owning bits of the read, in registration order.
Layout = tuple[tuple[StepListener, int], ...]
layout: Layout = ()  # (listener, shift) of every listener owning bits of the read, as laid out now
EVENTS = ("scale", "unscale", "read")  # the events a listener hears only while subscribed
_subscribed: dict[str, list[StepListener]] = {event: [] for event in EVENTS}
# Read by the scaler before it tells an event (empty: nobody to call on a healthy step).
hearing_scale: tuple[StepListener, ...] = ()
hearing_unscale: tuple[StepListener, ...] = ()
hearing_read: tuple[StepListener, ...] = ()  # the listeners that override on_read
# (listener, shift) of the subscribed listeners owning bits of the read: they add their fields (encode()).
adding_to_read: Layout = ()
# The listeners that override each of these methods: only they are called (the others' would do nothing).
_OVERRIDABLE = (
    "on_update",
    "on_device_update",
    "on_counters_read",
    "on_step_pending",
    "on_step_known",
    "on_overflow_known",
)
overriding: dict[str, tuple[StepListener, ...]] = dict.fromkeys(_OVERRIDABLE, ())
no_fields: dict[StepListener, int] = {}  # every field 0: a read that carried none


class GradientHolders(NamedTuple):
    """Where a capability keeps the parameters' gradients for the step (master weights: in their float32 masters),
    as the scaler's ``unscale_`` and the clip ask for them."""

    # (optimizer, scaler or None) -> (parameter, the tensor holding its gradient) for every parameter; with the
    # scaler (its unscale_), the gradients are first moved where they are held.
    of_optimizer: Callable[..., list[tuple[Tensor, Tensor | None]]]
    # parameters -> (parameter, its gradient) for those with one
    of_parameters: Callable[[Iterable[Tensor]], list[tuple[Tensor, Tensor]]]


gradient_holders: GradientHolders | None = None  # read inline by the scaler's unscale_ and the clip


def hold_gradients(holders: GradientHolders | None) -> None:
    """``holders`` answer where gradients are from now on (a patch's ``apply()``; None in its ``revert()``)."""
    global gradient_holders
    gradient_holders = holders


def gradients(optimizer: Any, scaler: Any = None) -> list[tuple[Tensor, Tensor | None]]:
    """``(parameter, the tensor holding its gradient)`` for every parameter of ``optimizer``, in param_groups order:
    a master's float32 gradient once ``unscale_`` copied it there, else ``p.grad``."""
    holders = gradient_holders
    if holders is not None:
        return holders.of_optimizer(optimizer, scaler)
    return [(p, p.grad) for group in optimizer.param_groups for p in group["params"]]


def gradient_pairs(params: Iterable[Tensor]) -> list[tuple[Tensor, Tensor]]:
    """``(parameter, gradient)`` for each of ``params`` with a gradient: a master's when it holds this iteration's."""
    holders = gradient_holders
    if holders is not None:
        return holders.of_parameters(params)
    return [(p, p.grad) for p in params if p.grad is not None]


def add(listener: StepListener, subscribed: tuple[str, ...] = EVENTS) -> None:
    """Register ``listener`` (a patch's ``apply()``), subscribed to ``subscribed``; registering it again changes
    nothing."""
    if listener in _listeners:
        return
    bits = sum(known.read_bits for known in _listeners) + listener.read_bits
    if bits > FIELD_BITS:
        raise ValueError(f"the listeners' fields need {bits} bits of the packed read; it has {FIELD_BITS}")
    _listeners.append(listener)
    for event in subscribed:
        _subscribed[event].append(listener)
    _relayout()


def remove(listener: StepListener) -> None:
    """Unregister ``listener`` (a patch's ``revert()``)."""
    if listener in _listeners:
        _listeners.remove(listener)
        for subscribers in _subscribed.values():
            if listener in subscribers:
                subscribers.remove(listener)
        _relayout()  # (also when it heard none of the events: it is in the update and read tuples)


def subscribe(listener: StepListener, *events: str) -> None:
    """``listener`` hears ``events`` (of :data:`EVENTS`) from now on."""
    missing = [event for event in events if listener not in _subscribed[event]]
    if missing and listener in _listeners:
        for event in missing:
            _subscribed[event].append(listener)
        _relayout()


def unsubscribe(listener: StepListener, *events: str) -> None:
    """``listener`` no longer hears ``events``."""
    subscribed = [event for event in events if listener in _subscribed[event]]
    if subscribed:
        for event in subscribed:
            _subscribed[event].remove(listener)
        _relayout()


def registered() -> tuple[StepListener, ...]:
    return tuple(_listeners)


def _relayout() -> None:
    global layout, hearing_scale, hearing_unscale, adding_to_read, hearing_read, overriding, no_fields
    hearing_read = tuple(known for known in _listeners if type(known).on_read is not StepListener.on_read)
    overriding = {
        method: tuple(
            known for known in _listeners if getattr(type(known), method) is not getattr(StepListener, method)
        )
        for method in _OVERRIDABLE
    }
    hearing_scale = tuple(known for known in _subscribed["scale"] if type(known).on_scale is not StepListener.on_scale)
    hearing_unscale = tuple(
        known for known in _subscribed["unscale"] if type(known).on_unscale is not StepListener.on_unscale
    )
    positions, shift = [], FIRST_FIELD_BIT
    for listener in _listeners:
        if listener.read_bits:
            positions.append((listener, shift))
            shift += listener.read_bits
    layout = tuple(positions)
    adding_to_read = tuple((listener, shift) for listener, shift in layout if listener in _subscribed["read"])
    no_fields = dict.fromkeys((listener for listener, _ in layout), 0)


# -- the scaler's side ----------------------------------------------------------------------------
# The scaler's parts call these with its handle (``self._handle``), which every listener receives in its place.
# The events of every step (on_read, on_update, the device-mode ones) are called by the scaler's part where they
# happen (accounting.HostBooks, ledger.DeviceBooks), from the tuples above, each call contained as failed() says.


def encode(handle: ScalerHandle, code: torch.Tensor) -> tuple[torch.Tensor, Layout]:
    """``code`` with the subscribed listeners' fields added (:data:`adding_to_read`), and the layout to decode the
    value read with."""
    laid_out = layout
    for listener, shift in adding_to_read:
        added = _guarded(listener, "step()", "add_to_read", handle, code, shift)
        code = code if added is None else added
    return code, laid_out


def decode(laid_out: Layout, value: int) -> dict[StepListener, int]:
    """Each listener's field of the value read (bits 2 and up), by listener (every one: ranks exchange them).

    (A value below :data:`FIELDS_START` read under the layout in force carries none: :data:`no_fields`, which the
    scaler takes without a call.)"""
    return {listener: (value >> shift) & ((1 << listener.read_bits) - 1) for listener, shift in laid_out}


def notify_scale(handle: ScalerHandle, scaled: Any) -> None:
    """(The scaler calls it only when :data:`hearing_scale` has listeners, as for the other events.)"""
    for listener in hearing_scale:
        _guarded(listener, "scale()", "on_scale", handle, scaled)


def notify_unscale(handle: ScalerHandle, optimizer: torch.optim.Optimizer) -> None:
    for listener in hearing_unscale:
        _guarded(listener, "unscale_()", "on_unscale", handle, optimizer)


def notify_foreign_step(owner: Any, forward_overflow: bool) -> None:
    for listener in _listeners:
        _guarded(listener, "foreign step", "on_foreign_step", owner, forward_overflow)


def stats_fields(handle: ScalerHandle) -> dict[str, Any]:
    """The fields every listener fills in ``scaler.stats``."""
    return _merged("stats", "stats_fields", handle)


def save(handle: ScalerHandle | Any, where: str = "state_dict()") -> dict[str, Any]:
    """Every listener's entries for ``scaler.state_dict()["ampguard"]`` (or its pickle: ``where``); ``handle``
    the scaler's, or DeepSpeed's counts (:meth:`StepListener.save`)."""
    return _merged(where, "save", handle)


def load(handle: ScalerHandle | Any, entries: dict[str, Any], where: str = "load_state_dict()") -> None:
    """Every listener's part of ``entries``, loaded into ``handle``'s scaler (or DeepSpeed's counts)."""
    for listener in _listeners:
        _guarded(listener, where, "load", handle, entries)


def _merged(where: str, method: str, *args: Any) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for listener in _listeners:
        merged.update(_guarded(listener, where, method, *args) or {})
    return merged


def _guarded(listener: StepListener, where: str, method: str, *args: Any) -> Any:
    """``listener.method(*args)``; None when it fails inside ampguard (reported once), torch's and the user's errors raised."""
    try:
        return getattr(listener, method)(*args)
    except Exception as error:
        failed(listener, where, error)
        return None


def failed(listener: StepListener, where: str, error: Exception) -> None:
    """A listener raised: torch's or the user's error raised again, ampguard's reported once (the step goes on)."""
    passing = containment.passes_through(error)
    if passing is not None:
        raise passing from None
    containment.report(f"{listener.name} ({where})", error)
