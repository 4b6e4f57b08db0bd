"""Which listeners a step concerns (ampguard/scaler/listeners.py): a healthy step calls none that it does not
concern, and what the features do is the same as when every listener hears every step."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from islands_support import HYPER, batch, fresh_islands, make_net, train  # noqa: F401  (fixture)
from scaler_support import ampguard_log, records  # noqa: F401  (fixture)
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


@pytest.mark.parametrize("fused", [False, True], ids=["host mode", "device mode (fused AdamW)"])
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
