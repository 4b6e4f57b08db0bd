"""The headroom watch with forward passes run in worker threads (a DataParallel-like wrapper)."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable

import pytest
import torch
from islands_support import batch, fresh_islands, make_net, train  # noqa: F401
from scaler_support import ampguard_log, one_thread, recipe_step, records  # noqa: F401  (fixtures)
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


class Gate(nn.Module):
    """Holds its thread inside the model (under the watch's mode) until told to go on, once ``gated``."""

    def __init__(self) -> None:
        super().__init__()
        self.gated = False
        self.inside, self.go_on = threading.Event(), threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            self.gated = False
            self.inside.set()
            assert self.go_on.wait(30)
        return x * 2


def gated_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), Gate(), nn.Linear(8, 8))


def gated_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
    recipe_step(optimizer, scaler, lambda: model(torch.ones(4, 8)).float().pow(2).mean())


def train_gated(while_inside: Callable[[], None]) -> tuple[list[torch.Tensor], int]:
    """Three steps in a worker thread, the second held inside the model while ``while_inside`` runs here; the
    parameters after, and the worker's dispatch mode stack's length at its end."""
    model = gated_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    gate, left = model[1], []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for step in range(3):
                gate.gated = step == 1  # the watched step (the watch begins at the first update)
                gated_step(model, optimizer, scaler)
            left.append(torch._C._len_torch_dispatch_stack())
        except BaseException as error:  # reported below
            errors.append(error)
            gate.inside.set()

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        assert gate.inside.wait(30)
        while_inside()
    finally:
        gate.go_on.set()
        thread.join(30)
    assert errors == [] and left, errors
    return [p.detach().clone() for p in model.parameters()], left[0]


def other_scaler_steps() -> None:
    model = gated_net()
    gated_step(model, torch.optim.SGD(model.parameters(), lr=0.01), torch.amp.GradScaler("cpu"))


def test_a_step_in_another_thread_leaves_the_watched_forward_alone(reinstall, ampguard_log):
    """A worker's update armed the watch and its model runs under the watch's mode when the main thread steps its own
    scaler (two threads training at once). The watch and its verdict are the worker's: the main thread's step leaves
    them alone (it used to leave the mode from the main thread's empty mode stack: RuntimeError into its step)."""
    reinstall(AMPGUARD_WATCH_EVERY="1")
    watched, left = train_gated(other_scaler_steps)
    assert left == 0 and torch._C._len_torch_dispatch_stack() == 0
    assert not records(ampguard_log, logging.WARNING), [r.getMessage() for r in ampguard_log.records]
    ampguard.uninstall()
    try:
        plain, _ = train_gated(other_scaler_steps)
    finally:
        ampguard.install()
    assert all(torch.equal(a, b) for a, b in zip(watched, plain))


def test_an_uninstall_while_a_worker_runs_under_the_watch_leaves_its_mode_with_its_call(reinstall, ampguard_log):
    """torch's mode stack is per thread: the worker leaves the mode itself, when the call that entered it returns."""
    reinstall(AMPGUARD_WATCH_EVERY="1")
    try:
        _, left = train_gated(ampguard.uninstall)
    finally:
        ampguard.install()
    assert left == 0 and torch._C._len_torch_dispatch_stack() == 0
    assert not records(ampguard_log, logging.WARNING), [r.getMessage() for r in ampguard_log.records]
