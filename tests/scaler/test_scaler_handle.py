"""What a feature holds of a SafeGradScaler: its ScalerHandle (ampguard/scaler/handle.py), never the scaler.

Every listener event carries the handle; its requests act as the scaler's own methods; it lives exactly as long as
its scaler (the features' weak structures release with it); copies and pickles of a scaler make their own.
"""

from __future__ import annotations

import copy
import gc
import math
import pickle
import weakref
from typing import Any

import pytest
import torch
from scaler_support import needs_fused_adam
from torch import nn

import ampguard
import ampguard.scaler.listeners as listeners
from ampguard.scaler.handle import ScalerHandle
from ampguard.underflow.listener import UnderflowListener

HOST_EVENTS = {"on_scale", "on_unscale", "add_to_read", "on_read", "on_update"}
DEVICE_EVENTS = {
    "on_scale",
    "on_unscale",
    "on_device_update",
    "on_counters_read",
    "on_step_pending",
    "on_step_known",
    "on_overflow_known",
}
EVERY_RUN = {"stats_fields", "save", "load"}  # scaler.stats, state_dict() / load_state_dict(), a deep copy


class Recorder(listeners.StepListener):
    """Hears every event (subscribed to all, one bit of the read, no wake_at): what it was given each time."""

    name = "recorder"
    read_bits = 1

    def __init__(self) -> None:
        super().__init__()
        self.heard: list[tuple[str, Any, tuple[Any, ...]]] = []

    def _note(self, event: str, handle: Any, *rest: Any) -> None:
        self.heard.append((event, handle, rest))

    def on_scale(self, handle: Any, scaled: Any) -> None:
        self._note("on_scale", handle)

    def on_unscale(self, handle: Any, optimizer: Any) -> None:
        self._note("on_unscale", handle)

    def add_to_read(self, handle: Any, code: torch.Tensor, shift: int) -> torch.Tensor:
        self._note("add_to_read", handle)
        return code

    def on_read(self, handle: Any, optimizer: Any, field: int, skipped: bool) -> None:
        self._note("on_read", handle, skipped)

    def on_update(self, handle: Any, verdict: Any, field: int) -> None:
        self._note("on_update", handle, verdict.found_inf, verdict.forward_overflow)

    def on_device_update(self, handle: Any, check: Any, held: bool, row: Any) -> bool | None:
        self._note("on_device_update", handle)
        return None

    def on_counters_read(
        self, handle: Any, forward_overflows: int, iterations: int, at_read: bool, current: bool
    ) -> None:
        self._note("on_counters_read", handle, forward_overflows)

    def on_step_pending(self, handle: Any, optimizer: Any) -> None:
        self._note("on_step_pending", handle)

    def on_step_known(self, handle: Any, optimizer: Any, skipped: bool) -> None:
        self._note("on_step_known", handle, skipped)

    def on_overflow_known(self, handle: Any, scale: float) -> None:
        self._note("on_overflow_known", handle, scale)

    def stats_fields(self, handle: Any) -> dict[str, Any]:
        self._note("stats_fields", handle)
        return {}

    def save(self, handle: Any) -> dict[str, Any]:
        self._note("save", handle)
        return {}

    def load(self, handle: Any, entries: dict[str, Any]) -> None:
        self._note("load", handle)


@pytest.fixture
def recorder():
    listener = Recorder()
    listeners.add(listener)
    try:
        yield listener
    finally:
        listeners.remove(listener)


def optimizer_for(model: nn.Module, fused: bool) -> torch.optim.Optimizer:
    if fused:
        return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    return torch.optim.SGD(model.parameters(), lr=0.01)


def train(scaler: ampguard.SafeGradScaler, model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    """Healthy steps, but step 2's gradients overflow (a finite loss) and step 4's loss is inf (a forward overflow)."""
    for step in range(steps):
        optimizer.zero_grad()
        loss = model(torch.ones(3, 4)).pow(2).sum()
        if step == 2:
            loss = loss * 1e36  # finite; scaled, its backward pass is not
        elif step == 4:
            loss = loss * math.inf
        scaler.scale(loss).backward()
        if not getattr(optimizer, "_step_supports_amp_scaling", False):
            scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()


@pytest.mark.parametrize(
    "fused", [False, pytest.param(True, marks=needs_fused_adam)], ids=["host mode", "device mode (fused AdamW)"]
)
def test_every_event_gives_a_listener_the_scalers_handle_never_the_scaler(fused, recorder):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = optimizer_for(model, fused)
    scaler = ampguard.SafeGradScaler("cpu", init_scale=1024.0)
    train(scaler, model, optimizer, steps=6)
    assert scaler.stats.skipped == 2 and scaler.stats.nonfinite_loss == 1  # (the two overflows happened)
    scaler.load_state_dict(scaler.state_dict())
    duplicate = copy.deepcopy(scaler)  # (saved through the scaler's pickle, loaded into the copy)

    heard = recorder.heard
    events = {event for event, _, _ in heard}
    assert events >= (DEVICE_EVENTS if fused else HOST_EVENTS) | EVERY_RUN, events
    assert all(type(handle) is ScalerHandle for _, handle, _ in heard)
    assert not any(isinstance(handle, torch.amp.GradScaler) for _, handle, _ in heard)
    copies = [handle for event, handle, _ in heard if handle is not scaler._handle]
    assert copies and all(handle is duplicate._handle for handle in copies)  # the copy's load only
    assert [event for event, handle, _ in heard if handle is duplicate._handle] == ["load"]
    if fused:  # both overflows reached the listener: the gradients' (its scale) and the loss's (its count)
        assert [rest for event, _, rest in heard if event == "on_overflow_known"] == [(1024.0,)]
        assert sum(rest[0] for event, _, rest in heard if event == "on_counters_read") == 1
    else:
        verdicts = [rest for event, _, rest in heard if event == "on_update"]
        assert verdicts.count((True, False)) == 1 and verdicts.count((True, True)) == 1


@pytest.mark.parametrize(
    "fused", [False, pytest.param(True, marks=needs_fused_adam)], ids=["host mode", "device mode (fused AdamW)"]
)
def test_the_handles_requests_act_as_the_scalers_own_methods(fused):
    """``grow_now`` and ``skip_step_if`` through the handle: the same scale, answer and skipped step as the direct
    call on an identical scaler; ``view()`` and ``steps`` are the scaler's."""
    runs = []
    for through_handle in (True, False):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        optimizer = optimizer_for(model, fused)
        scaler = ampguard.SafeGradScaler("cpu", init_scale=1024.0)
        train(scaler, model, optimizer, steps=2)
        asking = scaler._handle if through_handle else scaler
        answer = asking.grow_now(below=math.inf)
        grown = scaler.get_scale()
        capped = asking.grow_now(below=grown * 1.5)  # below the ceiling: no growth
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(3, 4)).sum()).backward()
        scaler.unscale_(optimizer)
        asking.skip_step_if(optimizer, torch.ones(()))
        scaler.step(optimizer)
        scaler.update()
        runs.append((answer, grown, capped, scaler.stats.skipped, scaler.get_scale()))
        handle = scaler._handle
        assert handle.steps == scaler.view().steps == handle.view().steps == 3
        assert handle.view().scale == scaler.view().scale and handle.view().last_skipped is True
    assert runs[0] == runs[1]
    assert runs[0][1] == 2048.0 and runs[0][3] == 1  # (it grew, and the step was skipped)
    assert runs[0][:3] == ((None, 2048.0, None) if fused else (2048.0, 2048.0, 2048.0))


def test_the_handle_lives_as_long_as_its_scaler_and_the_features_let_go_of_it(reinstall):
    """With the features that keep per-scaler state (underflow sampling every step, the headroom watch): once the
    scaler is dropped its handle is gone, and with it their entries."""
    reinstall(AMPGUARD_UNDERFLOW="adapt", AMPGUARD_UNDERFLOW_EVERY="1", AMPGUARD_WATCH_EVERY="2")
    [underflow] = [known for known in listeners.registered() if isinstance(known, UnderflowListener)]
    model = nn.Linear(4, 2)
    optimizer = optimizer_for(model, fused=False)
    scaler = ampguard.SafeGradScaler("cpu", init_scale=1024.0)
    train(scaler, model, optimizer, steps=6)
    handle = weakref.ref(scaler._handle)
    key = id(scaler._handle)
    assert scaler._handle in underflow.states
    keyed = [known for known in listeners.registered() if key in known.wake_at]
    assert keyed  # (the listeners keep their schedule for it)
    gc.collect()
    gc.disable()  # freed by reference counting alone, as the scaler always was: nothing holds it in a cycle
    try:
        del scaler
        assert handle() is None
    finally:
        gc.enable()
    assert len(underflow.states) == 0
    assert not any(key in known.wake_at for known in listeners.registered())


def test_a_handle_kept_past_its_scaler_answers_harmlessly():
    model = nn.Linear(4, 2)
    optimizer = optimizer_for(model, fused=False)
    scaler = ampguard.SafeGradScaler("cpu", init_scale=1024.0)
    train(scaler, model, optimizer, steps=2)
    handle = scaler._handle
    del scaler
    gc.collect()
    view = handle.view()
    assert (handle.steps, view.steps, view.scale, view.scale_on_device, view.scale_given) == (2, 2, None, None, True)
    assert handle.grow_now(below=math.inf) is None
    handle.skip_step_if(optimizer, torch.ones(()))  # (nothing to ask)
    assert "scaler gone" in repr(handle)


def test_copies_and_pickles_of_a_scaler_never_carry_or_share_its_handle(reinstall):
    """A deep copy and an unpickled scaler get their own handle, so the features' state for them is their own
    (the underflow state: equal at the copy, apart after); ``load_state_dict`` keeps the scaler's handle."""
    reinstall(AMPGUARD_UNDERFLOW="adapt", AMPGUARD_UNDERFLOW_EVERY="2")
    [underflow] = [known for known in listeners.registered() if isinstance(known, UnderflowListener)]
    model = nn.Linear(4, 2)
    optimizer = optimizer_for(model, fused=False)
    scaler = ampguard.SafeGradScaler("cpu", init_scale=1024.0)
    train(scaler, model, optimizer, steps=6)
    handle = scaler._handle
    assert "_handle" not in scaler.__getstate__()
    with pytest.raises(TypeError):
        pickle.dumps(handle)
    with pytest.raises(TypeError):
        copy.deepcopy(handle)
    duplicate = copy.deepcopy(scaler)
    unpickled = pickle.loads(pickle.dumps(scaler))
    handles = {id(handle), id(duplicate._handle), id(unpickled._handle)}
    assert len(handles) == 3
    assert all(type(known._handle) is ScalerHandle for known in (duplicate, unpickled))
    original, copied = underflow.states[handle], underflow.states[duplicate._handle]
    assert copied is not original and (copied.next_sample, copied.samples) == (original.next_sample, original.samples)
    train(duplicate, model, optimizer, steps=4)
    assert copied.samples > original.samples and underflow.states[handle] is original
    scaler.load_state_dict(duplicate.state_dict())
    assert scaler._handle is handle and underflow.states[handle].samples == copied.samples
