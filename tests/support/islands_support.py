"""A tiny multi-block attention model whose block ``blocks.1.attn`` overflows float16 on every 10th batch.

Block 1's attention has query/key weights scaled up: on an ordinary batch its
logits stay well inside float16 (a few thousand), on every ``EVERY``-th batch
(inputs 30x larger) they pass 65504, so under fp16 autocast the logits are inf
and the softmax gives NaN, inside ``blocks.1.attn`` only. In float32 the same
logits are harmless, and the classification loss (cross-entropy) keeps the
gradients bounded whatever the input size.
"""

from __future__ import annotations

import gc
import itertools
import math
from collections import namedtuple
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from scaler_support import recipe_step
from torch import nn

import ampguard
import ampguard.scaler
from ampguard import syncs
from ampguard.fp32_islands.islands import Islands
from ampguard.fp32_islands.patch import applied_healing
from ampguard.syncs import HostReadCounter

DIM = 16
TOKENS = 6
BATCH = 4
CLASSES = 4
EVERY = 10


class Attention(nn.Module):
    def __init__(self, dim: int, sharpness: float = 1.0) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        with torch.no_grad():
            self.q.weight.mul_(sharpness)
            self.k.weight.mul_(sharpness)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.q(x) @ self.k(x).transpose(-1, -2) / math.sqrt(x.shape[-1])
        return self.out(logits.softmax(-1) @ self.v(x))


class BoxedAttention(Attention):
    """The same attention, taking its input inside a container (``unpack``). Not scriptable: tests script Attention."""

    def forward(self, x: Any) -> torch.Tensor:
        return super().forward(unpack(x))


class Block(nn.Module):
    def __init__(self, dim: int, sharpness: float = 1.0, pack: Callable[[torch.Tensor], Any] | None = None) -> None:
        super().__init__()
        self.attn = Attention(dim, sharpness) if pack is None else BoxedAttention(dim, sharpness)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.pack = pack  # how the attention's input is handed to it: the tensor itself, or inside a container

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x if self.pack is None else self.pack(x))
        return x + self.mlp(x) * 0.1


class Net(nn.Module):
    def __init__(
        self, blocks: int = 3, hot: int = 1, sharpness: float = 36.0, pack: Callable[[torch.Tensor], Any] | None = None
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            Block(DIM, sharpness if i == hot else 0.3, pack if i == hot else None) for i in range(blocks)
        )
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1))


def one_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
    """One float16-autocast iteration of a model that maps a (4, 8) batch to its loss."""
    recipe_step(optimizer, scaler, lambda: model(torch.randn(4, 8)))


def make_net(seed: int = 0, pack: Callable[[torch.Tensor], Any] | None = None) -> Net:
    """The 3-block net; ``pack``: how the hot block hands its attention its input (e.g. in a namedtuple)."""
    torch.manual_seed(seed)
    return Net(pack=pack)


Hidden = namedtuple("Hidden", "hidden positions")


@dataclass(frozen=True)
class HiddenState:
    hidden: Any
    positions: torch.Tensor


def unpack(box: Any) -> torch.Tensor:
    """The hidden states inside ``box``: a tensor, Hidden, HiddenState, a ModelOutput or a dict or UserDict of them."""
    while not isinstance(box, torch.Tensor):
        if hasattr(box, "last_hidden_state"):
            box = box.last_hidden_state
        elif isinstance(box, Mapping):  # a dict, a UserDict (a tokenizer's BatchEncoding)
            box = box["state"]
        else:
            box = box.hidden
    return box


class MoE(nn.Module):
    """Tokens routed to two experts, dispatched as code written for autocast does it: ``out`` is float16.

    ``experts.1`` (an attention over the tokens routed to it) overflows float16 on every ``EVERY``-th batch.
    """

    DISPATCH = ("mask", "index_add_", "index_copy_", "scatter_")

    def __init__(self, dispatch: str = "mask") -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.router = nn.Linear(DIM, 2)
        self.experts = nn.ModuleList([Attention(DIM, 0.3), Attention(DIM, 60.0)])
        self.head = nn.Linear(DIM, CLASSES)
        self.dispatch = dispatch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).reshape(-1, DIM)
        choice = self.router(h).argmax(-1)
        out = torch.zeros_like(h)
        for number, expert in enumerate(self.experts):
            if self.dispatch == "mask":
                mask = choice == number
                out[mask] = expert(h[mask])
                continue
            index = (choice == number).nonzero().squeeze(1)
            if self.dispatch == "index_add_":
                out.index_add_(0, index, expert(h[index]))
            elif self.dispatch == "index_copy_":
                out.index_copy_(0, index, expert(h[index]))
            else:
                out.scatter_(0, index[:, None].expand(-1, DIM), expert(h[index]))
        return self.head((h + out).reshape(x.shape).mean(1))


def make_moe(dispatch: str = "mask", seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    return MoE(dispatch)


def overflows(step: int) -> bool:
    return step % EVERY == EVERY - 1


def batch(step: int, healthy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, TOKENS, DIM, generator=gen)
    if overflows(step) and not healthy:
        x = x * 8.0
    return x, torch.randint(0, CLASSES, (BATCH,), generator=gen)


@dataclass
class Result:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Any
    scales: list[float] = field(default_factory=list)
    nonfinite_losses: int = 0


def train(
    steps: int,
    *,
    model: nn.Module | None = None,
    scaler: Any = None,
    start: int = 0,
    optimizer: torch.optim.Optimizer | None = None,
    healthy: bool = False,
    check_losses: bool = True,
    after_update: Any = None,
    batch_of: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> Result:
    """fp16 autocast on CPU with a GradScaler (default: whatever class ``torch.amp.GradScaler`` is now).

    ``model`` is what is called (a wrapper of the trained module, with ``optimizer`` given, works too).
    ``healthy``: no batch overflows. ``check_losses``: count non-finite losses (one host read per step).
    ``after_update(step)`` runs after each ``scaler.update()``. ``batch_of(step)``: the batches, instead of
    :func:`batch`.
    """
    model = make_net() if model is None else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01) if optimizer is None else optimizer
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=100) if scaler is None else scaler
    result = Result(model, optimizer, scaler)
    for step in range(start, start + steps):
        x, y = batch(step, healthy) if batch_of is None else batch_of(step)
        loss = recipe_step(optimizer, scaler, lambda: nn.functional.cross_entropy(model(x), y))  # noqa: B023
        if check_losses and not torch.isfinite(loss):
            result.nonfinite_losses += 1
        if check_losses:
            result.scales.append(scaler.get_scale())
        if after_update is not None:
            after_update(step)
    return result


@pytest.fixture
def fresh_islands():
    """Islands and reports are process state: the test starts without any (install again), and without earlier
    tests' models still waiting in reference cycles (islands are named and restored among the live models)."""
    gc.collect()
    ampguard.uninstall()
    ampguard.install()


@pytest.fixture
def probe_only(monkeypatch: pytest.MonkeyPatch):
    """No headroom watch (AMPGUARD_WATCH_EVERY=0): for tests of the probe itself, the fallback when the watch has
    no suspect (with the watch, the module it saw closest to the limit is named at the first overflow)."""
    monkeypatch.setenv("AMPGUARD_WATCH_EVERY", "0")
    ampguard.uninstall()
    ampguard.install()


# -- references and runs shared by the islands', watch's and row copies' tests ----------------------------------

HYPER = {"init_scale": 1024.0, "growth_interval": 100}


def stock_scaler() -> ampguard.scaler.TorchGradScaler:
    """torch's own GradScaler (not patched) with the settings of these tests."""
    return ampguard.scaler.TorchGradScaler("cpu", **HYPER)


def fused(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def fused_runs(steps: int) -> tuple[Result, Result]:
    """The net with ``AdamW(fused=True)`` for ``steps``: under torch's GradScaler, then under ampguard's."""
    reference_model = make_net()
    reference = train(
        steps,
        model=reference_model,
        optimizer=fused(reference_model),
        scaler=ampguard.scaler.TorchGradScaler("cpu", **HYPER),
    )
    model = make_net()
    return reference, train(steps, model=model, optimizer=fused(model))


def reads_by_step(steps: int) -> tuple[dict[int, int], int, tuple[str, ...]]:
    """Train the 3-block net with fused AdamW: ampguard's reads after each update (steps 2..), torch's, the islands."""
    model = make_net()
    scaler = torch.amp.GradScaler("cpu", **HYPER)
    reads_so_far: list[int] = []
    with HostReadCounter() as torch_reads:
        train(
            steps,
            model=model,
            optimizer=fused(model),
            scaler=scaler,
            check_losses=False,
            after_update=lambda step: reads_so_far.append(syncs._reads_by_ampguard),
        )
    per_step = [now - before for before, now in itertools.pairwise(reads_so_far)]
    reads_at = {step: n for step, n in enumerate(per_step, start=2) if n}
    return reads_at, torch_reads.by_source["aten::_local_scalar_dense"], scaler.stats.fp32_islands  # model alive


class Storm(nn.Module):
    """inf on every loud batch in any precision (float32 too): an island of it cannot help."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return torch.where(x.abs().amax() > 15, y * float("inf"), y)


HALF_STEPS = 30  # loud batches at 9, 19, 29 (the net of half_net, ``model.half()`` without autocast)


def half_net() -> Net:
    torch.manual_seed(0)
    return Net(blocks=2, hot=1, sharpness=30.0)


def ampguard_loop(model: nn.Module) -> tuple[list[int], torch.amp.GradScaler]:
    """A float16 model trained without autocast under ampguard's GradScaler (float32 masters for its float16
    parameters): the steps whose loss was inf/NaN, and the scaler."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    lost = []
    for step in range(HALF_STEPS):
        x, y = batch(step)
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x.half()).float(), y)
        if not torch.isfinite(loss):
            lost.append(step)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return lost, scaler


def applied_islands() -> Islands:
    """The islands of the fp32_islands patch as applied now (a new set after each install)."""
    healing = applied_healing()
    assert healing is not None, "the fp32_islands patch is applied"
    return healing.islands
