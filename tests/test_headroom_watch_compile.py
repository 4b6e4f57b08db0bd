"""Review of the headroom watch with torch.compile regions inside a model that is not compiled as a whole."""

from __future__ import annotations

import pytest
import torch
from islands_support import fresh_islands  # noqa: F401
from scaler_support import one_thread  # noqa: F401  (fixtures)
from torch import nn

from ampguard.patch import torch_release

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_islands")


@pytest.mark.parametrize(
    "every",
    [
        "0",
        pytest.param(
            "1",
            marks=pytest.mark.xfail(
                torch_release().release >= (2, 4),  # torch 2.3.1's dynamo runs it under the mode (a graph break)
                strict=True,
                reason="open (docs/islands.md, limits): a compiled submodule runs eagerly on watched steps",
            ),
        ),
    ],
)
def test_a_compiled_submodule_runs_its_compiled_graph_on_watched_steps(reinstall, every: str):
    """``model.encoder = torch.compile(encoder)`` (a common partial compile): dynamo does not run compiled code while a
    TorchDispatchMode is active, so on each watched iteration the region runs eagerly (with inductor: other kernels,
    other float16 rounding, so the watched step's results differ from an unwatched one's, and it is slower). The docs
    promise compiled code is "not watched (nor changed)"; only a compiled root is handled."""
    reinstall(AMPGUARD_WATCH_EVERY=every)
    ran: list[int] = []

    def backend(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        def compiled(*args: torch.Tensor):
            ran.append(1)
            return graph.forward(*args)

        return compiled

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = torch.compile(nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)), backend=backend)
            self.head = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(x)).float().mean()

    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for _ in range(5):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 8))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    assert len(ran) == 5  # the compiled graph ran at every forward pass, as with the watch off (today: 1 of 5)
