"""Review of islands made by the headroom watch in a model stored in float16 and trained without autocast."""

from __future__ import annotations

import logging

import pytest
import torch
from islands_support import batch, fresh_islands  # noqa: F401
from scaler_support import ampguard_log, one_thread, records  # noqa: F401  (fixtures)
from test_islands_half_no_autocast import ampguard_loop, half_net

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_islands")


def test_an_island_of_a_float16_model_without_autocast_computes_in_float32(ampguard_log):
    """``model.half()`` trained without autocast (masters on), every 10th batch 8x louder. In float32 the loud batches
    are finite; the watch blames blocks.1.attn at the first (step 9) and makes it an island, which casts its
    float16 inputs, parameters and buffers to float32 for each call (no autocast to switch off) and gives its
    output back in float16: the next loud batches train. (Before: q, k, v still got float16 inputs and weights,
    every loud batch stayed lost, and ampguard said "float32 does not fix this overflow".)"""
    with torch.no_grad():
        assert torch.isfinite(half_net()(batch(9)[0])).all()  # the same net in float32: the loud batch is harmless
    model = half_net().half()
    lost, scaler = ampguard_loop(model)
    assert scaler.stats.fp32_islands == ("blocks.1.attn",)
    assert lost == [9]  # the island made at the first loud batch fixes the next ones
    assert not records(ampguard_log, logging.WARNING, "float32 does not fix this overflow")
