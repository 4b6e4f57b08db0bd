"""Review of the headroom watch in report mode (``AMPGUARD_FP32_ISLANDS=report``: name, change nothing)."""

from __future__ import annotations

import logging

import islands_support
import pytest
import torch
from islands_support import Net, batch, fresh_islands  # noqa: F401
from scaler_support import ampguard_log, one_thread, records  # noqa: F401  (fixtures)
from torch import nn

import ampguard.fp32_islands.islands as islands

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
    assert not any(islands.holds(module) for module in model.modules())
    assert scaler.stats.headroom[0][0] == "blocks.1.attn"
