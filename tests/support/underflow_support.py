"""The 2-block attention net of issue 24: small per-element gradients that float16 flushes at a low loss scale.

A 4-class sequence task (the first token modulo 4 is the label) learned by an
embedding, two pre-norm attention blocks and a classifier, in float16 autocast on the CPU. ``loss_factor``
multiplies the loss (1e-8 in the issue: the gradients then live in float16's subnormal range at a loss scale
of 1024) and SGD's learning rate is divided by it, so in float32 every factor trains the same.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

DIM = 32
TOKENS = 16
LENGTH = 8
CLASSES = 4
BATCH = 32


class AttentionBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        weights = torch.softmax(q @ k.transpose(-1, -2) / DIM**0.5, dim=-1)
        x = x + self.proj(weights @ v)
        return x + self.down(torch.relu(self.up(self.norm2(x))))


class AttentionNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(TOKENS, DIM)
        self.blocks = nn.ModuleList([AttentionBlock(), AttentionBlock()])
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=1))


def batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, TOKENS, (BATCH, LENGTH), generator=generator)
        labels = tokens[:, 0] % CLASSES
        out.append((tokens, labels))
    return out


@dataclass
class Run:
    losses: list[float] = field(default_factory=list)
    scaler: Any = None
    model: nn.Module | None = None

    def tail_mean(self, count: int = 50) -> float:
        return sum(self.losses[-count:]) / count


def train(
    scaler: Any = None,
    *,
    loss_factor: float = 1.0,
    steps: int = 300,
    fp16: bool = True,
    seed: int = 0,
    optimizer_class: Any = torch.optim.SGD,
    faults: Iterable[int] = (),
    between: Callable[[int, Any], Any] | None = None,
) -> Run:
    """SGD (lr 0.1 / loss_factor) on the attention net; the losses recorded are the unmultiplied ones.

    ``optimizer_class``: another SGD-like class taking ``(params, lr=)`` (scaler_support.DeviceSkipSGD: the
    scaler's device mode). On the ``faults`` steps (0-based) a scaled gradient is made inf. ``between(step,
    scaler)``, before each step (0-based), returns the scaler to go on with (a resumed one, or the same).
    """
    torch.manual_seed(seed)
    model = AttentionNet()
    optimizer = optimizer_class(model.parameters(), lr=0.1 / loss_factor)
    faults = set(faults)
    run = Run(scaler=scaler, model=model)
    for step, (tokens, labels) in enumerate(batches(steps)):
        if between is not None:
            scaler = run.scaler = between(step, scaler)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss = nn.functional.cross_entropy(model(tokens).float(), labels)
        run.losses.append(float(loss.detach()))
        if scaler is None:
            (loss * loss_factor).backward()
            optimizer.step()
        else:
            scaler.scale(loss * loss_factor).backward()
            if step in faults:
                model.head.weight.grad[0, 0] = float("inf")
            scaler.step(optimizer)
            scaler.update()
    return run


# -- the training-loop tests' modules (tests/underflow/test_underflow_training_loops.py) ---------------------------


class Marker:
    """An object only a live autograd node keeps alive (on its ctx)."""


class Tagged(torch.autograd.Function):
    """Identity; its node holds a :class:`Marker` until the node is freed."""

    markers: ClassVar[list[weakref.ref[Marker]]] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        marker = Marker()
        ctx.marker = marker
        Tagged.markers.append(weakref.ref(marker))
        return x.clone()

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> torch.Tensor:
        return gradient


class TaggedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Tagged.apply(self.lin(x))


class SlicesOfLinear(nn.Module):
    """A projection whose output is sliced and indexed (rotary embeddings' halves, a class token), and modified in
    place through a slice."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        y[:, 6:] *= 2.0  # CopySlices over y, MulBackward0 of the two columns
        return torch.cat([y[:, :3], y[:, 3:6], y[:, 6:], y[:, 0:1]], dim=1)


def transfers_known_after(polls: int, waits: list[int] | None = None) -> type:
    """The underflow listener's ``Transfer`` as on CUDA, to patch into ``ampguard.underflow.listener``: a sample's
    counts are found on the host after ``polls`` polls of it (one per update). ``waits`` (when given) gets the
    step of each sample whose result was asked for before that (a read that waits for the GPU on CUDA)."""
    from ampguard.underflow.counts import Transfer

    seen: list[int] = []

    class CudaTransfer(Transfer):
        @property
        def ready(self) -> bool:
            seen.append(self.step)
            return seen.count(self.step) > polls

        def result(self) -> Any:
            if waits is not None and not self.ready:
                waits.append(self.step)
            return super().result()

    return CudaTransfer
