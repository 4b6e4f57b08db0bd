"""Review of the headroom watch's schedule (every ``AMPGUARD_WATCH_EVERY`` optimizer steps) with several optimizers."""

from __future__ import annotations

import pytest
import torch
from islands_support import batch, fresh_islands, make_net  # noqa: F401
from scaler_support import one_thread  # noqa: F401  (fixtures)
from torch import nn

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_islands")


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
