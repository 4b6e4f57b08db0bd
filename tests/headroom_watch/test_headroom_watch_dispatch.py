"""The headroom watch's pass (its module hooks and TorchDispatchMode) against plain torch."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch
from islands_support import fresh_islands, one_step  # noqa: F401
from scaler_support import ampguard_log, one_thread, records  # noqa: F401  (fixtures)
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import ampguard
from ampguard.headroom_watch.sighting import FOLD, fold, summarise

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_islands")


class Recurrent(nn.Module):
    """A cell applied once per time step inside one forward pass (an RNN, a decoding loop)."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.cell = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.steps = steps
        self.interrupt = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for _ in range(self.steps):
            h = torch.tanh(self.cell(h))
            if self.interrupt:
                raise KeyboardInterrupt  # Ctrl-C in a notebook, in the middle of the forward pass
        return self.head(h).float().mean()


def setup(steps: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
    torch.manual_seed(0)
    model = Recurrent(steps)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, optimizer, torch.amp.GradScaler("cpu", init_scale=1024.0)


def test_a_keyboard_interrupt_in_a_watched_forward_leaves_no_dispatch_mode(reinstall, ampguard_log):
    """torch calls always_call forward hooks on an Exception, not on a KeyboardInterrupt: the watch's dispatch mode
    stayed pushed and its module stack never emptied, so every op the user ran next (evaluation, generation in the
    notebook) went through Python and was sampled, with no MAX_PASSES bound, until some step() came. The next module
    call finds the interrupted calls' frames gone: the watch ends there (one INFO line), and the pass runs as under
    torch; training then goes on as under torch."""
    reinstall(AMPGUARD_WATCH_EVERY="1")
    model, optimizer, scaler = setup(steps=3)
    one_step(model, optimizer, scaler)  # the next iteration is watched
    model.interrupt = True
    with pytest.raises(KeyboardInterrupt), torch.autocast("cpu", dtype=torch.float16):
        model(torch.randn(4, 8))
    model.interrupt = False
    modes = []  # the dispatch mode around each call of the cell (inside the module: the watch's, if any)
    handle = model.cell.register_forward_pre_hook(lambda *_: modes.append(_get_current_dispatch_mode()))
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            model(torch.randn(4, 8))  # plain torch: an ordinary forward pass, no mode around it
            assert _get_current_dispatch_mode() is None
        assert modes == [None] * 3
        assert len(records(ampguard_log, logging.INFO, "ended in an exception its module hooks never see")) == 1
        one_step(model, optimizer, scaler)  # the iteration goes on, unwatched; the next one is watched again
        one_step(model, optimizer, scaler)
        assert scaler.stats.headroom and scaler.stats.headroom[0][0] == "cell"
    finally:
        handle.remove()
        ampguard.uninstall()  # (the mode, left pushed, must not leak into the next test)
        ampguard.install()


class Interruptible(nn.Linear):
    """A cell whose forward raises KeyboardInterrupt once when told to, after computing its output."""

    interrupt = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if self.interrupt:
            self.interrupt = False
            raise KeyboardInterrupt
        return y


class Guarded(nn.Module):
    """A forward that catches a KeyboardInterrupt from its cell and goes on with a louder module."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = Interruptible(8, 8)
        self.loud = nn.Linear(8, 8)
        with torch.no_grad():
            self.loud.weight.mul_(100.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            self.cell(x)
        except KeyboardInterrupt:
            pass
        return self.loud(x).float().mean()


def test_a_keyboard_interrupt_caught_inside_a_watched_forward_leaves_the_rest_of_the_pass_watched(reinstall):
    """Only the calls the interrupt ended are dropped: the forward that caught it goes on being watched (the module
    called after it is measured), and no mode is left pushed after the forward; the weights are torch's."""

    def trained() -> tuple[list[torch.Tensor], list[str]]:
        torch.manual_seed(0)
        model = Guarded()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        one_step(model, optimizer, scaler)
        model.cell.interrupt = True
        one_step(model, optimizer, scaler)  # watched (when ampguard is installed)
        assert _get_current_dispatch_mode() is None
        names = [name for name, _ in scaler.stats.headroom] if hasattr(scaler, "stats") else []  # (torch: none)
        return [p.detach().clone() for p in model.parameters()], names

    reinstall(AMPGUARD_WATCH_EVERY="1")
    under_ampguard, names = trained()
    assert names[:1] == ["loud"]
    ampguard.uninstall()
    try:
        plain, _ = trained()
    finally:
        ampguard.install()
    assert all(torch.equal(a, b) for a, b in zip(under_ampguard, plain))


def live_tensors() -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))


@pytest.mark.parametrize("every", ["0", "1"])
def test_a_watched_pass_keeps_memory_per_module_not_per_call(reinstall, every: str):
    """One forward pass calling a cell 2,000 times: the watch kept a (min, max) pair of 0-dim device tensors for every
    float16 op of every call until step() (4,000 tensors here; a decoding loop under gradient accumulation: millions,
    each its own allocation on a GPU). A module's pairs are folded every 32 into a running peak."""
    reinstall(AMPGUARD_WATCH_EVERY=every)
    model, optimizer, scaler = setup(steps=2000)
    one_step(model, optimizer, scaler)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        before = live_tensors()
        model(torch.randn(4, 8))  # watched when every == 1 (an evaluation pass before the step)
        kept = live_tensors() - before
    assert kept < 100  # a few per module, as with the watch off


@pytest.mark.parametrize("nonfinite", [None, float("nan"), float("inf")])
def test_folded_samples_give_the_verdict_and_peaks_of_all_of_them(nonfinite: float | None):
    """Pairs folded as the watch folds them (every 32, folded pairs folded again) summarise as the pairs themselves:
    the same verdict, peaks, order and non-finite flag, with sentinels (+-65,504) still not counted as peaks."""
    gen = torch.Generator().manual_seed(0)
    values = (torch.randn(3, 300, generator=gen) * torch.tensor([[30.0], [9000.0], [200.0]])).half()
    values[1, 7], values[2, 250] = 65504.0, -65504.0  # sentinels in the loudest and another module
    if nonfinite is not None:
        values[0, 123] = nonfinite
    pairs = [[(v.minimum(-v.abs() / 2), v.maximum(v.abs() / 3)) for v in row] for row in values]
    folded = []
    for row in pairs:
        kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        for pair in row:
            kept.append(pair)
            if len(kept) >= FOLD:
                kept = fold(kept)
        folded.append(kept)
    assert all(len(kept) < FOLD for kept in folded)
    modules = [(weakref.ref(nn.Linear(1, 1)), weakref.ref(nn.Linear(1, 1)))] * 3
    plain, small = (summarise(samples, modules, [None] * 3, 4096.0, 2) for samples in (pairs, folded))
    assert plain.read_verdict() == small.read_verdict() == 2
    assert plain.top == small.top and plain.overflowed == small.overflowed == (nonfinite is not None)


def test_a_nested_tensor_in_a_watched_pass_does_not_stop_the_watch(reinstall, ampguard_log):
    """A float16 nn.TransformerEncoder evaluated with a padding mask takes torch's fast path, which packs the batch
    into a nested tensor (layout strided, dtype float16): ``aminmax`` has no NestedTensor kernel, so the watch stops
    for the rest of the run (one WARNING holding torch's whole dispatcher table, about 10 KB)."""
    reinstall(AMPGUARD_WATCH_EVERY="1")
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2).half()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    padding = torch.zeros(4, 6, dtype=torch.bool)
    padding[:, 5] = True
    for _ in range(3):
        x = torch.randn(4, 6, 16).half()
        optimizer.zero_grad(set_to_none=True)
        model.train()
        loss = model(x).float().pow(2).mean()
        model.eval()
        with torch.no_grad():
            model(x, src_key_padding_mask=padding)  # an evaluation pass inside the watched iteration
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    assert not records(ampguard_log, logging.WARNING, "headroom watch stopped")
    assert scaler.stats.headroom  # it still watches


def test_a_ddp_wrappers_own_code_runs_outside_the_watchs_dispatch_mode(reinstall, tmp_path, monkeypatch):
    """DDP rebuilds its gradient buckets in its forward at the second iteration, the one the watch sees: made under a
    Python dispatch mode, each bucket gets a Python object, and a gloo thread that frees one must take the GIL (on
    torch < 2.8 the job hung in destroy_process_group: docs/distributed.md). The model inside is watched as before."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    reinstall()
    pre_forward_modes, cell_modes = [], []
    original = DistributedDataParallel._pre_forward

    def recorded(self, *args, **kwargs):
        pre_forward_modes.append(_get_current_dispatch_mode())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DistributedDataParallel, "_pre_forward", recorded)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        inner, _, scaler = setup(steps=2)
        inner.cell.register_forward_pre_hook(lambda *_: cell_modes.append(_get_current_dispatch_mode()))
        model = DistributedDataParallel(inner)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(3):
            one_step(model, optimizer, scaler)
        tightest = [name for name, _ in scaler.stats.headroom]  # named while the DDP root lives
        del model, optimizer  # DDP is gone before the group (examples/ddp_train.py)
    finally:
        dist.destroy_process_group()
    assert pre_forward_modes == [None] * 3
    # The second iteration is watched: the cell's two calls ran under the watch's mode, the others under none.
    assert [mode is not None for mode in cell_modes] == [False, False, True, True, False, False]
    assert tightest[:1] == ["cell"]
