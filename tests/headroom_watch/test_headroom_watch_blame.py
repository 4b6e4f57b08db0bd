"""The headroom watch's blame at a sudden forward overflow (issue 23 item 3), against the probe alone.

The net is tests/support/islands_support.py's: ``blocks.1.attn`` has logits within 64x of float16's limit on every batch (the
watch's suspect), but here it never overflows: the overflow comes from elsewhere.
"""

from __future__ import annotations

import logging

import pytest
import torch
from islands_support import CLASSES, DIM, batch, fresh_islands, make_net  # noqa: F401
from scaler_support import ampguard_log, one_thread, records  # noqa: F401  (fixtures)
from torch import nn

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_islands")


class SpikyHead(nn.Module):
    """The classifier head, scaling its logits up by ``gain`` and back down: in float16 a spike batch's 1e6 is inf."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, CLASSES)
        self.gain = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.gain / self.gain  # harmless in float32


SPIKES = (5, 8, 11, 14)


class OnceOnlyHead(SpikyHead):
    """A spiky head whose forward cannot be run again: it needs autograd (the forward run again has none)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            raise RuntimeError("this head needs autograd")
        return super().forward(x)


def run(
    head: bool, nan_batch: int | None = None, steps: int = 30, head_class: type[SpikyHead] = SpikyHead
) -> tuple[list[int], tuple[str, ...]]:
    lost, islands, _ = run_model(head, nan_batch, steps, head_class)
    return lost, islands


def run_model(
    head: bool, nan_batch: int | None = None, steps: int = 30, head_class: type[SpikyHead] = SpikyHead
) -> tuple[list[int], tuple[str, ...], nn.Module]:
    model = make_net()
    if head:
        model.head = head_class()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=100)
    lost = []
    for step in range(steps):
        x, y = batch(step, healthy=True)
        if step == nan_batch:
            x[0, 0, 0] = float("nan")  # a corrupt sample: the data's fault, no module's
        if head:
            model.head.gain = 1e6 if step in SPIKES else 1.0
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        if not torch.isfinite(loss):
            lost.append(step)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return lost, scaler.stats.fp32_islands, model


def test_a_sudden_overflow_elsewhere_makes_no_wrong_island_and_loses_one_batch(reinstall):
    """The head overflows at steps 5, 8, 11, 14. Before its forward ran again (ampguard/fp32_islands/rerun.py), the
    watch blamed blocks.1.attn (its tightest) at step 5: a permanent wrong island, and the head was found one
    overflow later than by the probe alone (3 batches lost, not 2)."""
    reinstall(AMPGUARD_WATCH_EVERY="0")  # the probe alone: no model seen before the overflow, so nothing to run again
    probe_lost, probe_islands = run(head=True)
    assert probe_lost == [5, 8] and probe_islands == ("head",)  # armed at 5, names the head at 8
    reinstall(AMPGUARD_WATCH_EVERY="100")
    lost, islands = run(head=True)
    assert "blocks.1.attn" not in islands  # it never overflowed
    assert lost == [5] and islands == ("head",)  # step 5's forward run again names the head at once


def test_a_nan_batch_makes_no_island(reinstall):
    """One sample of the data is NaN at step 5: no module overflowed (the probe alone makes no island). The watch
    saw blocks.1.attn within the blame bound; before the inputs were checked it made it a permanent island and told
    the user to make it permanent in their code."""
    reinstall(AMPGUARD_WATCH_EVERY="0")
    assert run(head=False, nan_batch=5) == ([5], ())
    reinstall(AMPGUARD_WATCH_EVERY="100")
    assert run(head=False, nan_batch=5) == ([5], ())


@pytest.mark.parametrize(
    ("setting", "head_class"),
    [("AMPGUARD_FORWARD_RERUN=off", SpikyHead), ("a forward run again that raises", OnceOnlyHead)],
)
def test_a_wrong_blame_is_taken_back_when_the_probe_names_the_real_module(reinstall, ampguard_log, setting, head_class):
    """Where the forward cannot run again, the watch's blame is all there is at step 5: blocks.1.attn (the tightest,
    never overflowing) is made an island. The overflows go on (the head's), the probe arms at 8 and names the head
    at 11: blocks.1.attn's island is taken back there (before: a permanent wrong island, float32 compute for good).
    From then on blocks.1.attn computes what plain torch computes, bit for bit."""
    variables = {"AMPGUARD_WATCH_EVERY": "100"}
    if setting == "AMPGUARD_FORWARD_RERUN=off":
        variables["AMPGUARD_FORWARD_RERUN"] = "off"
    reinstall(**variables)
    lost, islands, model = run_model(head=True, head_class=head_class)
    assert lost == [5, 8, 11] and islands == ("head",)
    made = records(ampguard_log, logging.WARNING, "fp32 island: blocks.1.attn (Attention) is taken for")
    taken_back = records(ampguard_log, logging.WARNING, "fp32 island blocks.1.attn (Attention) taken back at step 12")
    assert len(made) == len(taken_back) == 1 and "head overflowed float16" in taken_back[0].getMessage()
    attn = model.blocks[1].attn
    x = batch(29, healthy=True)[0].requires_grad_()
    with torch.autocast("cpu", dtype=torch.float16):
        out = attn(x)
        plain = type(attn).forward(attn, x)  # torch's own forward: no module hook runs
    assert out.dtype == plain.dtype == torch.float16 and torch.equal(out, plain)
