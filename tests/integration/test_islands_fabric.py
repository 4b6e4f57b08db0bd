"""fp32 island names under Lightning Fabric: relative to the model the script passed to ``fabric.setup``.

``fabric.setup(model)`` returns a ``_FabricModule`` holding the model as
``_original_module`` and ``_forward_module`` (the same model, or DDP around it).
The island is named in the user's model (``blocks.1.attn``, not
``_forward_module.blocks.1.attn``), so ``model.get_submodule(name)`` works on the
model the script built, on the Fabric wrapper (which passes attribute lookups on),
and in a run without Fabric; a checkpoint naming it the earlier way still re-applies.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import pytest
import torch
from integration_support import require
from torch import nn

L = require("lightning")
import islands_support  # noqa: E402
from islands_support import (  # noqa: E402, F401  (fixture)
    EVERY,
    applied_islands,
    fresh_islands,
)
from lightning.fabric.plugins.precision import MixedPrecision  # noqa: E402
from scaler_support import ampguard_log, records  # noqa: E402, F401  (fixture)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("fresh_islands")]


def fabric_run(steps: int, state: dict | None = None, start: int = 0, make: Any = islands_support.make_net):
    """Fabric's 16-mixed on CPU (float16 autocast) with a handed-in scaler, the recipe loop, every 10th batch hot."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=100)
    if state is not None:
        scaler.load_state_dict(state)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=MixedPrecision("16-mixed", "cpu", scaler=scaler))
    net = make()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
    lost = 0
    for step in range(start, start + steps):
        x, y = islands_support.batch(step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = nn.functional.cross_entropy(model(x), y)
        lost += not bool(torch.isfinite(loss))
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
        optimizer.step()
        optimizer.zero_grad()
    return net, model, scaler, lost


def test_the_island_is_named_in_the_model_the_script_passed_to_fabric(ampguard_log):
    net, model, scaler, lost = fabric_run(3 * EVERY)
    assert lost == 1 and scaler.stats.fp32_islands == ("blocks.1.attn",)  # blamed by the headroom watch at once
    assert net.get_submodule("blocks.1.attn") is net.blocks[1].attn and applied_islands().holds(net.blocks[1].attn)
    assert model.get_submodule("blocks.1.attn") is net.blocks[1].attn  # the wrapper passes the lookup on
    made = records(ampguard_log, logging.WARNING, "fp32 island:")[0].getMessage()
    assert made.startswith("fp32 island: blocks.1.attn (Attention)") and "(model: your Net)" in made
    assert scaler.state_dict()["ampguard"]["fp32_islands"] == ["blocks.1.attn"]


@pytest.mark.parametrize("saved", ["blocks.1.attn", "_forward_module.blocks.1.attn"])
def test_a_checkpointed_island_re_attaches_under_fabric_by_either_name(reinstall, ampguard_log, saved):
    """The name as saved now, and as saved before Fabric's wrapper was seen through (relative to the wrapper)."""
    _, _, scaler, _ = fabric_run(3 * EVERY)
    state = scaler.state_dict()
    state["ampguard"]["fp32_islands"] = [saved]
    reinstall()
    net, _, resumed, lost = fabric_run(3 * EVERY, state=state, start=3 * EVERY)
    assert lost == 0 and applied_islands().holds(net.blocks[1].attn)
    assert resumed.stats.fp32_islands == ("blocks.1.attn",)
    assert len(records(ampguard_log, logging.INFO, "fp32 island blocks.1.attn (Attention) re-applied")) == 1


class OverflowsInItsOwnCode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(islands_support.DIM, islands_support.DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * 25.0
        return (h @ h.transpose(-1, -2)).mean(-1)[..., : islands_support.CLASSES]  # overflows outside any submodule


def test_an_overflow_in_the_model_s_own_code_under_fabric_is_reported_not_made_a_whole_model_island(ampguard_log):
    """The wrapper's only child is the model itself: it is the root, not a submodule to run in float32."""
    net, _, scaler, _ = fabric_run(3 * EVERY, make=OverflowsInItsOwnCode)
    assert scaler.stats.fp32_islands == () and not applied_islands().holds(net)
    assert len(records(ampguard_log, logging.WARNING, "forward overflow located in OverflowsInItsOwnCode itself")) == 1
