"""A sudden forward overflow costs one batch: its forward runs again under the probe (ampguard/fp32_islands/rerun.py).

The reference for what is lost is the probe alone (``AMPGUARD_FORWARD_RERUN=off``:
armed at the first overflow, naming the module at the second); the reference for
what the run becomes is the same run with the re-run off, up to the overflow's
update: the random streams, the buffers and the modules' counters are as if the
forward had not run again.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import pytest
import torch
from islands_support import fresh_islands  # noqa: F401  (fixture)
from scaler_support import ampguard_log, needs_fused_adam, one_thread, records  # noqa: F401  (fixtures)
from torch import nn
from torch.nn import functional as F

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_islands")

DIM = 16
LOUD = {6, 13, 20}  # the steps whose batch makes `blocks.1.attn`'s logits overflow (and nothing before warns)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.out((q @ k.transpose(-1, -2) / math.sqrt(DIM)).softmax(-1) @ v)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(6)  # running statistics: a forward run again must not move them
        self.attn = Attention()
        self.drop = nn.Dropout(0.1)  # the random stream: the next batch's mask as without the re-run
        self.calls = 0  # a Python counter: put back too

    def forward(self, x: torch.Tensor, *, gain: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.drop(self.attn(self.norm(x) * gain))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor, gains: torch.Tensor) -> torch.Tensor:
        for block, gain in zip(self.blocks, gains):
            x = block(x, gain=gain)
        return self.head(x.mean(1))


@dataclass
class Run:
    lost: list[int]
    islands: tuple[str, ...]
    after_update: dict[int, tuple[torch.Tensor, list[torch.Tensor], list[int]]]  # step -> (rng, buffers, calls)


def batches(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    gains = torch.ones(3)
    if step in LOUD:
        gains[1] = 400.0  # block 1's attention logits pass 65,504 under float16
    return torch.randn(4, 6, DIM, generator=gen), torch.randint(0, 4, (4,), generator=gen), gains


def train(steps: int = 24, fused: bool = False, generator_input: bool = False) -> Run:
    torch.manual_seed(1)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=100)
    run = Run([], (), {})
    for step in range(steps):
        x, y, gains = batches(step)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x, iter(gains) if generator_input else gains), y)
        if not torch.isfinite(loss):
            run.lost.append(step)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        buffers = [b.clone() for b in model.buffers()]
        run.after_update[step] = (torch.get_rng_state(), buffers, [int(b.calls) for b in model.blocks])
    run.islands = scaler.stats.fp32_islands
    return run


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=needs_fused_adam)], ids=["adamw", "fused-adamw"])
def test_a_sudden_overflow_costs_one_batch_and_leaves_the_run_as_without_the_rerun(reinstall, ampguard_log, fused):
    reinstall(AMPGUARD_FORWARD_RERUN="off")
    probe = train(fused=fused)
    assert probe.lost == [6, 13] and probe.islands == ("blocks.1.attn",)  # the probe alone: armed at 6, names at 13
    reinstall(AMPGUARD_FORWARD_RERUN="on")
    ampguard_log.clear()
    ours = train(fused=fused)
    assert ours.lost == [6] and ours.islands == ("blocks.1.attn",)
    made = records(ampguard_log, logging.WARNING, "fp32 island: blocks.1.attn (Attention) overflowed float16")
    assert len(made) == 1 and "step 7" in made[0].getMessage()
    # Up to the overflow's update the two runs are one: its forward run again left no trace.
    for step in range(7):
        rng, buffers, calls = ours.after_update[step]
        rng_off, buffers_off, calls_off = probe.after_update[step]
        assert torch.equal(rng, rng_off), step
        assert all(torch.equal(a, b) for a, b in zip(buffers, buffers_off)), step
        assert calls == calls_off == [step + 1] * 3


def test_an_input_the_forward_consumes_is_not_run_again_and_the_probe_finds_the_module(reinstall, ampguard_log):
    reinstall()
    run = train(generator_input=True)
    assert run.lost == [6, 13] and run.islands == ("blocks.1.attn",)  # as the probe alone
    said = records(ampguard_log, logging.INFO, "its forward pass is not run again")
    assert len(said) == 1 and "iterator or a generator" in said[0].getMessage()


def test_a_forward_that_raises_when_run_again_falls_back_to_the_probe(reinstall, ampguard_log, monkeypatch):
    """A model whose forward cannot run twice (it raised the second time): training goes on as with the probe."""
    reinstall()
    calls = {"n": 0}
    original = Net.forward

    def forward_once_per_step(self: Net, x: torch.Tensor, gains: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            raise RuntimeError("this forward runs once per batch")
        calls["n"] += 1
        return original(self, x, gains)

    monkeypatch.setattr(Net, "forward", forward_once_per_step)
    run = train()
    assert run.lost == [6, 13] and run.islands == ("blocks.1.attn",)
    said = records(ampguard_log, logging.INFO, "its forward pass is not run again")
    assert len(said) == 1 and "this forward runs once per batch" in said[0].getMessage()
    assert calls["n"] == 24
