"""The headroom watch with models of particular kinds, against plain torch.

torch.compile regions inside a model that is not compiled as a whole, activation checkpointing, and a model stored
in float16 and trained without autocast.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import islands_support
import pytest
import torch
from islands_support import Block, ampguard_loop, batch, fresh_islands, half_net, make_net, one_step  # noqa: F401
from scaler_support import (  # noqa: F401  (fixtures)
    ampguard_log,
    one_thread,
    records,
)
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import ampguard
from ampguard.patch import torch_release

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_islands")


def train(model: nn.Module, steps: int, begun: list[int] | None = None) -> torch.amp.GradScaler:
    """``steps`` float16 training steps of ``model`` (SGD), each step's index appended to ``begun`` as it starts."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(steps):
        if begun is not None:
            begun.append(step)
        one_step(model, optimizer, scaler)
    return scaler


@pytest.mark.parametrize("every", ["0", "1"])
def test_a_compiled_submodule_runs_its_compiled_graph_on_watched_steps(reinstall, every: str):
    """``model.encoder = torch.compile(encoder)`` (a common partial compile): the watch's mode lets dynamo run compiled
    code (``ignore_compile_internals``; on a torch without it the watch does not enter its mode once anything was
    compiled), so the region runs its compiled graph on watched steps too: the same kernels as without ampguard."""
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
    train(Model(), 5)
    assert len(ran) == 5  # the compiled graph ran at every forward pass, as with the watch off


@pytest.mark.xfail(
    torch_release().release < (2, 4),
    strict=True,
    reason="not ampguard's: torch 2.3.1's dynamo skips torch.nn's own frames, so an nn.Sequential compiled in place "
    "runs eagerly there, without ampguard too (no graph); and that torch's watch does not watch a model holding a "
    "compiled submodule (its dispatch modes cannot let compiled code through: docs/islands.md)",
)
def test_a_submodule_compiled_in_place_compiles_a_bounded_number_of_graphs_and_runs_compiled_at_every_step(reinstall):
    """``model.encoder.compile()`` compiles the submodule's own call, guarded on the global module hooks' keys. The
    watch re-arms its hooks under the same keys (ampguard.module_hooks): a graph with its hooks (and one for the step
    where the buffer guard's hook is there too) besides the one without, whatever the number of watched steps. Before,
    new keys at every watched step compiled it again each time, and past the recompile limit it ran eagerly for good;
    before that, under the mode, it ran eagerly on every watched step."""
    reinstall(AMPGUARD_WATCH_EVERY="2", AMPGUARD_UNDERFLOW="off")  # (the underflow patch's own hooks: not this test)
    graphs: list[int] = []
    ran: set[int] = set()
    steps: list[int] = []  # the steps begun

    def backend(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        graphs.append(1)

        def compiled(*args: torch.Tensor):
            ran.add(len(steps) - 1)
            return graph.forward(*args)

        return compiled

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
            self.encoder.compile(backend=backend)
            self.head = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(x)).float().mean()

    torch.manual_seed(0)
    model = Model()
    watched: list[bool] = []  # whether the head ran under the watch's dispatch mode, per step
    model.head.register_forward_pre_hook(lambda *_: watched.append(_get_current_dispatch_mode() is not None))
    train(model, 12, steps)
    assert len(graphs) <= 3  # (torch 2.14: without hooks, with the watch's and the buffer guard's, with the watch's)
    assert sorted(ran) == list(range(12))  # compiled at every step, watched or not
    assert watched == [False, True] * 6  # steps 1, 3, 5, ... are watched


def test_a_submodule_compiled_with_fullgraph_trains_on_watched_steps(reinstall):
    """``encoder.compile(fullgraph=True)``: under the watch's dispatch mode dynamo skipped the region, and fullgraph
    made a skipped frame an error ("found no compiled frames"): the run died at the first watched step. The sampler
    armed at the same steps."""

    def trained() -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        model[0].compile(backend="eager", fullgraph=True)
        train(Wrapped(model), 3)
        return [p.detach().clone() for p in model.parameters()]

    reinstall(AMPGUARD_WATCH_EVERY="1", AMPGUARD_UNDERFLOW_EVERY="1")
    under_ampguard = trained()
    assert all(torch.equal(a, b) for a, b in zip(under_ampguard, under_plain_torch(trained)))


def under_plain_torch(trained: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
    """``trained()`` with ampguard uninstalled and dynamo's caches emptied (ampguard installed again after)."""
    ampguard.uninstall()
    torch._dynamo.reset()
    try:
        return trained()
    finally:
        ampguard.install()


class Wrapped(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).float().mean()


def test_a_model_compiled_whole_is_said_once_not_to_be_watched(reinstall, ampguard_log):
    """``torch.compile(model)``: nothing of it is left to watch; the watch says so once at INFO (before: silently),
    and the run is torch's."""
    reinstall(AMPGUARD_WATCH_EVERY="1", AMPGUARD_UNDERFLOW="off")

    def trained() -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = Wrapped(nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)))
        train(torch.compile(model, backend="eager"), 4)
        return [p.detach().clone() for p in model.parameters()]

    under_ampguard = trained()
    said = records(ampguard_log, logging.INFO, "runs compiled and is not watched")
    assert len(said) == 1 and "torch.compile of Wrapped" in said[0].getMessage()
    assert all(torch.equal(a, b) for a, b in zip(under_ampguard, under_plain_torch(trained)))


# -- activation checkpointing (torch.utils.checkpoint) on the CPU ----------------------------


def checkpointed_block_forward(self: Block, x: torch.Tensor) -> torch.Tensor:
    x = x + torch.utils.checkpoint.checkpoint(self.attn, x, use_reentrant=False)
    return x + self.mlp(x) * 0.1


def tightest(model: nn.Module) -> tuple[str, float]:
    return islands_support.train(3, model=model, healthy=True, check_losses=False).scaler.stats.headroom[0]


def test_a_checkpointed_attention_keeps_its_logits_watched(reinstall, monkeypatch):
    """Checkpointing recomputes the attention in backward(), on the CPU in the caller's thread: the watch takes the
    recomputation for a new outermost call and strikes the attention off the candidates ("called as the root too"), so
    its logits (thousands here, its own code's) are no longer seen: the module the watch exists for is invisible."""
    reinstall(AMPGUARD_WATCH_EVERY="1")
    plain = tightest(make_net())
    assert plain[0] == "blocks.1.attn" and plain[1] > 65504 / 64
    monkeypatch.setattr(Block, "forward", checkpointed_block_forward)
    assert tightest(make_net()) == plain  # the same forward pass, the same peaks


# -- a model stored in float16 and trained without autocast ----------------------------------


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
