"""Review of the headroom watch with activation checkpointing (torch.utils.checkpoint) on the CPU."""

from __future__ import annotations

import pytest
import torch
from islands_support import Block, batch, fresh_islands, make_net, train  # noqa: F401
from scaler_support import one_thread  # noqa: F401  (fixtures)
from torch import nn

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_islands")


def checkpointed_block_forward(self: Block, x: torch.Tensor) -> torch.Tensor:
    x = x + torch.utils.checkpoint.checkpoint(self.attn, x, use_reentrant=False)
    return x + self.mlp(x) * 0.1


def tightest(model: nn.Module) -> tuple[str, float]:
    return train(3, model=model, healthy=True, check_losses=False).scaler.stats.headroom[0]


def test_a_checkpointed_attention_keeps_its_logits_watched(reinstall, monkeypatch):
    """Checkpointing recomputes the attention in backward(), on the CPU in the caller's thread: the watch takes the
    recomputation for a new outermost call and strikes the attention off the candidates ("called as the root too"), so
    its logits (thousands here, its own code's) are no longer seen: the module the watch exists for is invisible."""
    reinstall(AMPGUARD_WATCH_EVERY="1")
    plain = tightest(make_net())
    assert plain[0] == "blocks.1.attn" and plain[1] > 65504 / 64
    monkeypatch.setattr(Block, "forward", checkpointed_block_forward)
    assert tightest(make_net()) == plain  # the same forward pass, the same peaks
