"""Review of the headroom watch with forward passes run in worker threads (a DataParallel-like wrapper)."""

from __future__ import annotations

import concurrent.futures
import logging

import pytest
import torch
from islands_support import batch, fresh_islands, make_net, train  # noqa: F401
from scaler_support import ampguard_log, one_thread, records  # noqa: F401  (fixtures)
from torch import nn

import ampguard

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_islands")


class ThreadedReplicas(nn.Module):
    """Splits the batch in two and runs the model on each half in its own thread, as ``nn.DataParallel`` does with
    ``parallel_apply`` (autocast entered again in each thread, as there); the outputs are concatenated."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.module = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def replica(half: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.float16):
                return self.module(half)

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            return torch.cat(list(pool.map(replica, x.chunk(2))))


def tightest(wrap: bool) -> str | None:
    model = make_net()
    called = ThreadedReplicas(model) if wrap else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    headroom = train(3, model=called, optimizer=optimizer, healthy=True, check_losses=False).scaler.stats.headroom
    return headroom[0][0] if headroom else None


def test_forward_passes_in_worker_threads_are_not_watched_and_it_is_said_once(reinstall, ampguard_log):
    """The watch keeps to the thread that called update() (its dispatch mode is thread-local), so a model run in
    worker threads is not watched (a coverage gap: the probe, a threading.local stack, does see such passes). It says
    so once, at INFO, naming the module and why; training is torch's."""
    reinstall(AMPGUARD_WATCH_EVERY="1")
    assert tightest(wrap=False) == "blocks.1.attn"
    assert not records(ampguard_log, logging.INFO, "not in the thread that trains")
    under_ampguard = trained(wrap=True)
    said = records(ampguard_log, logging.INFO, "not in the thread that trains")
    assert len(said) == 1 and "`Net`" in said[0].getMessage(), [r.getMessage() for r in said]
    ampguard.uninstall()
    try:
        plain = trained(wrap=True)
    finally:
        ampguard.install()
    # The two halves' gradients accumulate in the order their backward passes end: plain torch differs from itself
    # by a few ulps from run to run here, so torch's result is met within float32 rounding, not bit for bit.
    for mine, reference in zip(under_ampguard, plain):
        torch.testing.assert_close(mine, reference)


def trained(wrap: bool) -> list[torch.Tensor]:
    model = make_net()
    called = ThreadedReplicas(model) if wrap else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    train(4, model=called, optimizer=optimizer, healthy=True, check_losses=False)
    return [p.detach().clone() for p in model.parameters()]
