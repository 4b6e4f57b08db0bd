"""Which listeners a step concerns (ampguard/scaler/listeners.py): a healthy step calls none that it does not
concern, and what the features do is the same as when every listener hears every step."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from islands_support import HYPER, batch, fresh_islands, make_net, train  # noqa: F401  (fixture)
from scaler_support import ampguard_log, needs_fused_adam, records  # noqa: F401  (fixture)
from torch import nn

import ampguard
import ampguard.scaler.listeners as listeners
from ampguard.fp32_islands.patch import IslandsListener
from ampguard.underflow.listener import UnderflowListener

pytestmark = pytest.mark.usefixtures("fresh_islands")


def everyone_hears_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatch before subscriptions and wake_at: every listener, every event, every step."""
    monkeypatch.setattr(listeners, "subscribe", lambda listener, *events: None)
    monkeypatch.setattr(listeners, "unsubscribe", lambda listener, *events: None)
    for event in listeners.EVENTS:
        listeners._subscribed[event][:] = list(listeners.registered())
    listeners._relayout()
    for listener in listeners.registered():
        monkeypatch.setattr(listener, "wake_at", _Awake())


class _Awake(dict):  # type: ignore[type-arg]
    """A wake_at that wakes at every step, whatever the listener asks for."""

    def get(self, key: Any, default: Any = None) -> int:
        return 0

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


def run(fused: bool, steps: int = 40) -> tuple[Any, list[torch.Tensor], list[str]]:
    torch.manual_seed(0)
    model = make_net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True) if fused else None
    loud = lambda step: (batch(step)[0], batch(step)[1])  # noqa: E731
    result = train(steps, model=model, optimizer=optimizer, scaler=torch.amp.GradScaler("cpu", **HYPER), batch_of=loud)
    return result.scaler.stats, [p.detach().clone() for p in model.parameters()], list(result.scales)


@pytest.mark.parametrize(
    "fused", [False, pytest.param(True, marks=needs_fused_adam)], ids=["host mode", "device mode (fused AdamW)"]
)
def test_the_features_act_as_when_every_listener_hears_every_step(fused, reinstall, monkeypatch):
    """Islands made (the watch's sighting, the probe), the scale and its growths, underflow samples and the
    scheduler's holds: the same whether healthy steps call the listeners they do not concern or not."""
    settings = {"AMPGUARD_WATCH_EVERY": "7", "AMPGUARD_UNDERFLOW": "adapt", "AMPGUARD_UNDERFLOW_EVERY": "5"}
    reinstall(**settings)
    gated = run(fused)
    reinstall(**settings)
    everyone_hears_everything(monkeypatch)
    reference = run(fused)
    assert gated[0] == reference[0]
    assert gated[2] == reference[2]
    assert all(torch.equal(a, b) for a, b in zip(gated[1], reference[1]))
    assert gated[0].fp32_islands and gated[0].underflow_samples >= 6 and gated[0].skipped  # (it did something)


def test_a_healthy_step_calls_only_the_listeners_it_concerns(reinstall, monkeypatch):
    """With the watch due every 10 steps and a sample every 10: the islands listener hears the updates of the
    watched iterations only, the underflow listener those of its samples; neither hears scale() or the read."""
    reinstall(AMPGUARD_WATCH_EVERY="10", AMPGUARD_UNDERFLOW="report", AMPGUARD_UNDERFLOW_EVERY="10")
    heard: dict[str, list[int]] = {"islands": [], "underflow": [], "scale": []}
    scaler = torch.amp.GradScaler("cpu", **HYPER)
    for cls, key in ((IslandsListener, "islands"), (UnderflowListener, "underflow")):
        original = cls.on_update
        monkeypatch.setattr(
            cls,
            "on_update",
            lambda self, s, v, f, o=original, k=key: heard[k].append(s.view().steps) or o(self, s, v, f),
        )
    original_scale = UnderflowListener.on_scale
    monkeypatch.setattr(
        UnderflowListener,
        "on_scale",
        lambda self, s, x: heard["scale"].append(s.view().steps) or original_scale(self, s, x),
    )
    model = make_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(30):
        x, y = batch(step, healthy=True)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    # the steps at those updates: the first (each listener meets the scaler), then the watch's and the sample's
    # (armed at the update of steps 1, 11, 21; their iterations' updates, 2, 12, 22, settle them)
    assert heard["islands"] == [1, 2, 11, 12, 21, 22], heard
    assert heard["underflow"] == [1, 2, 11, 12, 21, 22], heard
    assert heard["scale"] == [1, 11, 21], heard  # scale() of the sampled iterations only (before their step)
    assert scaler.stats.underflow_samples == 3 and scaler.stats.headroom


def test_an_overflow_reaches_every_listener(reinstall, ampguard_log, monkeypatch):
    reinstall(AMPGUARD_WATCH_EVERY="0", AMPGUARD_UNDERFLOW="report", AMPGUARD_UNDERFLOW_EVERY="1000")
    heard: list[tuple[str, bool]] = []
    for cls, key in ((IslandsListener, "islands"), (UnderflowListener, "underflow")):
        original = cls.on_update
        monkeypatch.setattr(
            cls,
            "on_update",
            lambda self, s, v, f, o=original, k=key: heard.append((k, v.found_inf)) or o(self, s, v, f),
        )
    result = train(10, scaler=torch.amp.GradScaler("cpu", **HYPER))  # the batch of step 9 overflows inside a block
    assert ("islands", True) in heard and ("underflow", True) in heard
    assert [found for _, found in heard].count(True) == 2 * result.scaler.stats.skipped
    assert records(ampguard_log, logging.INFO, "fp32 island") or ampguard.SafeGradScaler  # (the probe armed)


def _one_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any, step: int, offset: int = 0) -> None:
    x, y = batch(step + offset)
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def handover_after_the_first_scaler_is_freed() -> tuple[Any, list[torch.Tensor]]:
    """A trains alone, B (with a BatchNorm after its head) joins with healthy batches, A's scaler is freed, and B
    trains on through forward overflows: buffer discovery passes to B's scaler at its next update, healthy or not
    (the review of the gated dispatch: it passed at B's first overflow, too late, and the BatchNorm kept NaN)."""
    import gc

    model_a = make_net(0)
    optimizer_a = torch.optim.SGD(model_a.parameters(), lr=0.01)
    scaler_a = torch.amp.GradScaler("cpu", **HYPER)
    for step in range(12):
        _one_step(model_a, optimizer_a, scaler_a, step, offset=1000)
    model_b = nn.Sequential(make_net(1), nn.BatchNorm1d(make_net(1).head.out_features))
    optimizer_b = torch.optim.SGD(model_b.parameters(), lr=0.01)
    scaler_b = torch.amp.GradScaler("cpu", **HYPER)
    for step in range(3):
        _one_step(model_a, optimizer_a, scaler_a, 20 + step, offset=1000)
        _one_step(model_b, optimizer_b, scaler_b, step, offset=1)
    del model_a, optimizer_a, scaler_a
    gc.collect()
    for step in range(3, 40):
        _one_step(model_b, optimizer_b, scaler_b, step)
    return scaler_b.stats, [t.detach().clone() for t in (*model_b.parameters(), *model_b.buffers())]


def rolled_back_to_an_earlier_checkpoint() -> tuple[Any, list[torch.Tensor]]:
    """40 steps, then the step-5 checkpoint (no island in it) loaded into the same scaler and 35 steps again: the
    watch's schedule starts again from the loaded steps (it slept until step 41)."""
    import copy

    model = make_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", **HYPER)
    saved = None
    for step in range(40):
        _one_step(model, optimizer, scaler, step)
        if step == 4:
            saved = copy.deepcopy((model.state_dict(), optimizer.state_dict(), scaler.state_dict()))
    assert saved is not None
    model.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    scaler.load_state_dict(saved[2])
    for step in range(5, 40):
        _one_step(model, optimizer, scaler, step, offset=1)
    return scaler.stats, [t.detach().clone() for t in (*model.parameters(), *model.buffers())]


@pytest.mark.parametrize(
    ("scenario", "watch_every"),
    [(handover_after_the_first_scaler_is_freed, None), (rolled_back_to_an_earlier_checkpoint, "5")],
    ids=["handover", "rollback"],
)
def test_what_the_gated_dispatch_missed_before_its_review(scenario, watch_every, reinstall, monkeypatch):
    settings = {"AMPGUARD_WATCH_EVERY": watch_every} if watch_every else {}
    reinstall(**settings)
    gated = scenario()
    reinstall(**settings)
    everyone_hears_everything(monkeypatch)
    reference = scenario()
    assert gated[0] == reference[0]
    assert all(torch.equal(a, b) for a, b in zip(gated[1], reference[1], strict=True))
    assert all(torch.isfinite(t).all() for t in gated[1])  # (the BatchNorm's statistics: put back)


def test_a_listener_removed_while_it_hears_nothing_is_called_no_more(reinstall, monkeypatch):
    """The underflow listener, between samples, is subscribed to no event; uninstalled then, it must leave the
    scaler's updates too (a SafeGradScaler kept after uninstall still called it at an overflow)."""
    # alone: no other listener's removal lays the dispatch out again after its own
    reinstall(
        AMPGUARD_UNDERFLOW="report", AMPGUARD_UNDERFLOW_EVERY="1000", AMPGUARD_DISABLE="fp32_islands,scheduler_hold"
    )
    heard: list[int] = []
    original = UnderflowListener.on_update
    monkeypatch.setattr(
        UnderflowListener, "on_update", lambda self, s, v, f: heard.append(s.view().steps) or original(self, s, v, f)
    )
    scaler = ampguard.SafeGradScaler("cpu", **HYPER)
    model = make_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(4):
        _one_step(model, optimizer, scaler, step)
    assert heard == [1, 2]  # its first sample: armed at 1, acted on at 2; then quiet
    ampguard.uninstall()
    try:
        for step in range(4, 12):  # the batch of step 9 overflows: an update that wakes every listener
            _one_step(model, optimizer, scaler, step)
    finally:
        ampguard.install()
    assert heard == [1, 2] and scaler.stats.skipped == 1
