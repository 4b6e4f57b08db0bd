"""How the headroom watch runs: report mode, its schedule, the scaler's device mode.

Report mode (``AMPGUARD_FP32_ISLANDS=report``: name, change nothing), the schedule (every ``AMPGUARD_WATCH_EVERY``
optimizer steps) with several optimizers, and a fused optimizer (the scaler's device mode) on a GPU, the device
mocked.
"""

from __future__ import annotations

import logging

import islands_support
import pytest
import torch
from islands_support import Net, applied_islands, batch, fresh_islands, make_net  # noqa: F401
from scaler_support import (  # noqa: F401  (fixtures)
    ampguard_log,
    needs_fused_adam,
    one_thread,
    records,
)
from torch import nn

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_islands")


def two_hot_blocks() -> Net:
    """Blocks 1 and 2 both have attention logits within AMPGUARD_HEADROOM=4 of float16's limit (block 1's higher)."""
    torch.manual_seed(0)
    model = Net(blocks=3, hot=1, sharpness=90.0)
    with torch.no_grad():
        model.blocks[2].attn.q.weight.mul_(70.0 / 0.3)
        model.blocks[2].attn.k.weight.mul_(70.0 / 0.3)
    return model


def train(steps: int) -> tuple[nn.Module, torch.amp.GradScaler]:
    model = two_hot_blocks()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    same_batch = batch(0, healthy=True)  # the peaks keep their order
    run = islands_support.train(
        steps, model=model, optimizer=optimizer, check_losses=False, batch_of=lambda _: same_batch
    )
    return model, run.scaler  # (islands live as long as their model)


def test_report_mode_names_every_module_auto_mode_would_make_an_island(reinstall, ampguard_log):
    """Auto mode makes both blocks islands (block 1 at one watch, block 2 at the next, once block 1 is an island and
    no longer a candidate). Report mode changes nothing, so block 1 stays the tightest module of every watch; once
    named, the verdict passes over it and block 2 is named at the next watch: each once, at WARNING, the model
    untouched (no island), and block 1 still shown as the tightest in the stats."""
    reinstall(AMPGUARD_WATCH_EVERY="1")
    _model, scaler = train(6)  # (the model held: islands live as long as it)
    assert scaler.stats.fp32_islands == ("blocks.1.attn", "blocks.2.attn")
    reinstall(AMPGUARD_WATCH_EVERY="1", AMPGUARD_FP32_ISLANDS="report")
    ampguard_log.clear()
    model, scaler = train(6)
    named = records(ampguard_log, logging.WARNING, "headroom watch: ")
    assert [record.getMessage().split(" ")[2] for record in named] == ["blocks.1.attn", "blocks.2.attn"]
    assert all("AMPGUARD_FP32_ISLANDS=report: nothing changed" in record.getMessage() for record in named)
    assert scaler.stats.fp32_islands == ()
    assert not any(applied_islands().holds(module) for module in model.modules())
    assert scaler.stats.headroom[0][0] == "blocks.1.attn"


# -- the schedule (every AMPGUARD_WATCH_EVERY optimizer steps) with several optimizers -------


@pytest.mark.parametrize("optimizers", [1, 2])
def test_the_watch_runs_with_two_optimizers_on_one_scaler(optimizers: int):
    """A body and a head with their own optimizers (AdamW + SGD, Muon + AdamW), one scaler, the default
    AMPGUARD_WATCH_EVERY=100: the schedule tests ``steps % 100 == 1`` on the scaler's step() count, which goes up by 2
    per iteration, so it is never odd: the watch never runs (no island ahead, no blame at a first overflow)."""
    model = make_net()
    body = [p for name, p in model.named_parameters() if not name.startswith("head")]
    chosen = (
        [torch.optim.SGD(model.parameters(), lr=0.01)]
        if optimizers == 1
        else [torch.optim.AdamW(body, lr=1e-3), torch.optim.SGD(model.head.parameters(), lr=0.01)]
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=100)
    for step in range(110):
        x, y = batch(step, healthy=True)
        for optimizer in chosen:
            optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        for optimizer in chosen:
            scaler.step(optimizer)
        scaler.update()
    headroom = scaler.stats.headroom
    assert headroom and headroom[0][0] == "blocks.1.attn"  # a watch ran and saw the attention's logits


# -- a fused optimizer (the scaler's device mode) on a GPU, the device mocked ----------------
# On CUDA the watch's summary reaches the host through a non-blocking copy and an event; a copy whose event is not
# reached yet is read with a sync (``ampguard.syncs.HostCopy.values``). Device mode learns each iteration's ledger row
# from its own host copy, queued *before* the watch's in ``update()``, and tells the listeners at the updates after.


@needs_fused_adam
def test_mocked_cuda_fused_optimizer_healthy_watched_steps_add_no_host_read(reinstall, monkeypatch):
    """The watch's copy is modelled as a GPU's: not reached during the update that queued it, reached by the next.
    Torch reads nothing on the host with a fused optimizer; ampguard must not either. Today the update of the watched
    iteration tells the listeners the rows known so far, and ``after_stats_read`` decodes the pending verdict at once
    from a copy queued microseconds earlier: one sync per watch."""
    from ampguard import syncs
    from ampguard.headroom_watch import sighting as headroom

    reinstall(AMPGUARD_WATCH_EVERY="5")
    updates = [0]
    reads: list[int] = []

    class GpuEvent:
        def __init__(self) -> None:
            self.queued_at = updates[0]

        def query(self) -> bool:
            return updates[0] > self.queued_at  # the device reaches the copy after the update that queued it

    class GpuCopy(syncs.HostCopy):
        def __init__(self, tensor: torch.Tensor) -> None:
            super().__init__(tensor)
            self.event = GpuEvent()

    def read_to_host(tensor: torch.Tensor) -> list[float]:
        reads.append(updates[0])
        return list(tensor.tolist())

    monkeypatch.setattr(headroom, "HostCopy", GpuCopy)
    monkeypatch.setattr(syncs, "read_to_host", read_to_host)
    torch.manual_seed(0)
    model = make_net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def one_update_later(step: int) -> None:
        updates[0] += 1

    islands_support.train(
        12, model=model, optimizer=optimizer, healthy=True, check_losses=False, after_update=one_update_later
    )
    assert reads == []  # healthy steps, watched ones included: no read torch does not make
