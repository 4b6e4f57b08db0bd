"""Issue 32: an exact zero that float32 also has is never "lost", and adapt never grows the scale for one.

A float16 gradient of exact zeros is either a true zero (a ``0.0 * aux_loss`` term, a loss weight ramped up from
0, a zero-initialised LoRA ``B``: float32 has the same zeros) or a flushed one (the scale too low: float32 holds
the values). Before, every gradient without a normal value counted as lost whole, so a run with a zero-weighted
auxiliary head reported 62% lost and 0% subnormal, adapt grew the scale 1024 -> 16384 for it, and a loud batch
then overflowed: a skip torch's schedule (``AMPGUARD_UNDERFLOW=off``) does not have. The references here: the same
backward pass in float32 (its zeros), the same model without the zero term, and ``off``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from scaler_support import ampguard_log, one_thread, records, same_parameters, stock  # noqa: F401
from torch import nn
from underflow_support import AttentionNet, batches

import ampguard
from ampguard.underflow.counts import Measurement, read
from ampguard.underflow.gradients import Gradients
from ampguard.underflow.measure import Sampler

pytestmark = pytest.mark.usefixtures("one_thread")

SCALE = 1024.0  # ampguard's initial scale


class LoRALinear(nn.Module):
    """A linear layer with a LoRA adapter whose ``B`` starts at zero (as LoRA initialises it)."""

    def __init__(self, width: int, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(width, width)
        self.A = nn.Linear(width, rank, bias=False)
        self.B = nn.Linear(rank, width, bias=False)
        nn.init.zeros_(self.B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.B(self.A(x))


class WithAux(nn.Module):
    """A trunk, a LoRA adapter, a 4-class head and a large auxiliary head (62% of the float16 gradient values). ``weight``: the aux
    loss's weight applied inside the model (a buffer, as a ramp from 0 keeps it); None: the model returns the aux
    output and the loop weighs it."""

    def __init__(self, weight: float | None = None) -> None:
        super().__init__()
        self.trunk = nn.Linear(16, 32)
        self.adapter = LoRALinear(32)
        self.head = nn.Linear(32, 4)
        self.aux = nn.Sequential(nn.Linear(32, 96), nn.ReLU(), nn.Linear(96, 32))
        self.weight = weight
        self.register_buffer("aux_weight", torch.tensor(weight if weight is not None else 0.0))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.adapter(torch.relu(self.trunk(x)))
        aux = self.aux(h)
        if self.weight is not None:
            return self.head(h), self.aux_weight * aux.float().square().mean()
        return self.head(h), aux


def loss_of(model: WithAux, x: torch.Tensor, y: torch.Tensor, aux_factor: float = 0.0, fp16: bool = True) -> Any:
    with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
        main, aux = model(x)
        loss = nn.functional.cross_entropy(main.float(), y)
        if model.weight is not None:
            return loss + aux
        return loss + aux_factor * aux.float().square().mean() if aux_factor is not None else loss


def data(step: int = 0, loud: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(64, 16, generator=generator) * loud, torch.randint(0, 4, (64,), generator=generator)


def sampled(model: nn.Module, loss_fn: Any) -> Measurement:
    """One backward pass at :data:`SCALE` with the sampler armed; its measurement."""
    sampler = Sampler()
    sampler.arm()
    model.zero_grad(set_to_none=True)
    (loss_fn() * SCALE).backward()
    sampler.count_parameters(model.parameters())  # (what its scaler's unscale_() has it do)
    return read(sampler.finish(), step=2, scale=SCALE)[0]


AUX = ("aux.0", "aux.1", "aux.2")


@pytest.mark.parametrize("weight", [None, 0.0], ids=["zero term in the loop", "zero weight inside the model"])
def test_an_all_zero_gradient_that_float32_has_too_is_not_lost(weight):
    """The aux head's gradients are exact zeros in float16 and in float32 (the reference, same batch and weights);
    the LoRA ``A``'s are too (``B`` is zero). None of them is lost or subnormal, and the step's counts equal those
    of the same backward pass without the zero term, but for the aux head's zero values."""
    torch.manual_seed(0)
    model = WithAux(weight)
    x, y = data()
    measured = sampled(model, lambda: loss_of(model, x, y))
    zero_params = [*model.aux.parameters(), model.adapter.A.weight]
    assert all(p.grad is None or not p.grad.any() for p in zero_params)
    model.zero_grad(set_to_none=True)
    (loss_of(model, x, y, fp16=False) * SCALE).backward()  # float32: the same zeros
    assert all(p.grad is None or not p.grad.any() for p in zero_params)
    assert model.trunk.weight.grad.count_nonzero() > 0

    for name in (*AUX, "adapter.A"):
        counts = measured.modules[name]
        assert counts.values > 0 and counts.flushed == 0 and counts.subnormal == 0, (name, counts)
    aux_values = sum(measured.modules[name].values for name in AUX)
    assert aux_values > 0.6 * measured.total.values  # (before: as much lost, 0% subnormal)
    assert measured.flushed_share == 0.0 and measured.underflow_share < 0.01

    without = WithAux(None)
    without.load_state_dict(model.state_dict())
    reference = sampled(without, lambda: loss_of(without, x, y, aux_factor=None))  # the aux head not in the loss
    for name, counts in reference.modules.items():
        assert (counts.flushed, counts.subnormal) == (measured.modules[name].flushed, measured.modules[name].subnormal)


def test_a_gradient_flushed_whole_is_lost_where_float32_holds_it():
    """The attention net's loss x 1e-8 at 1024: the head's gradient holds subnormals only (degraded, not lost, but
    for its zeros), every gradient below it is exact zeros in float16, while float32 holds every parameter's
    gradient nonzero: nearly all of it is lost, the rest subnormal. At 1e-10 even the head's gradient is zero (no
    gradient of the step holds a normal value): all lost."""
    torch.manual_seed(0)
    model = AttentionNet()
    tokens, labels = batches(1)[0]

    def loss(factor: float, fp16: bool = True) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            return nn.functional.cross_entropy(model(tokens).float(), labels) * factor

    for factor in (1e-8, 1e-10):
        measured = sampled(model, lambda factor=factor: loss(factor))
        assert measured.flushed_share == 1.0 if factor == 1e-10 else measured.flushed_share > 0.99
        assert measured.underflow_share == 1.0
        model.zero_grad(set_to_none=True)
        (loss(factor, fp16=False) * SCALE).backward()
        assert all(p.grad.count_nonzero() > 0 for p in model.parameters() if p.grad is not None)


class Fading(nn.Module):
    """Linear layers whose gradient fades by about 1e-3 per layer going down: at scale 1024 the top layers' float16
    gradients are normal, the middle ones subnormal, the bottom ones exact zeros (float32 holds them all)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(32, 32) for _ in range(6)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            x = layer(x) * (1e-2 if index else 1.0)
        return x


def test_gradients_flushed_whole_below_normal_ones_are_lost():
    """The step holds normal values (the top layers), so an exact-zero gradient is not lost for lack of any: those
    of the bottom layers are lost because the gradients they were computed from held no normal value. Checked
    against float32: the bottom layers' parameter gradients are nonzero there, zero in float16."""
    torch.manual_seed(0)
    model = Fading()
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))

    def loss(fp16: bool = True) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            return model(x).float().sum() / 64

    measured = sampled(model, loss)
    fp16_zero = [not layer.weight.grad.any() for layer in model.layers]
    model.zero_grad(set_to_none=True)
    (loss(fp16=False) * SCALE).backward()
    assert all(layer.weight.grad.count_nonzero() == layer.weight.numel() for layer in model.layers)
    assert fp16_zero[:2] == [True, True] and fp16_zero[-1] is False  # flushed at the bottom, not at the top
    assert measured.total.peak >= 2.0**-14
    for index, zero in enumerate(fp16_zero):
        counts = measured.modules[f"layers.{index}"]
        if zero:  # its weight's gradient lost whole; its output's gradient subnormal or lost
            assert counts.sunk >= model.layers[index].weight.numel(), (index, counts)
            assert counts.share(counts.underflow) > 0.99, (index, counts)
    assert measured.modules["layers.5"].flushed == 0


@pytest.mark.parametrize("weight", [None, 0.0], ids=["zero term in the loop", "zero weight inside the model"])
def test_without_torchs_current_node_true_zeros_are_still_not_lost(monkeypatch, weight):
    """A torch without ``torch._C._current_autograd_node`` (nothing passes down the graph): every all-zero gradient
    is judged by the step, lost only when no gradient held a normal value. The zero terms are not lost; the
    loss x 1e-8 net at 1024 is nearly all lost still (the head's subnormals are not)."""
    import ampguard.underflow.measure as measure

    monkeypatch.setattr(measure, "_current_node", lambda: None)
    torch.manual_seed(0)
    model = WithAux(weight)
    x, y = data()
    measured = sampled(model, lambda: loss_of(model, x, y))
    assert measured.flushed_share == 0.0 and measured.underflow_share < 0.01
    net = AttentionNet()
    tokens, labels = batches(1)[0]

    def tiny() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            return nn.functional.cross_entropy(net(tokens).float(), labels) * 1e-8

    assert sampled(net, tiny).flushed_share > 0.99


def test_true_zeros_of_one_gradient_are_not_counted_lost_for_anothers_small_values():
    """A ReLU-masked gradient (true zeros, its other values normal) and, in the same module, a gradient with values
    in float16's two lowest subnormal octaves but no zero: nothing was flushed. Before, the module's zeros and low
    values were pooled and the mask's zeros counted as lost (min(zeros, low values))."""
    sample = Gradients()
    sample.names[0] = "layer"
    masked = torch.tensor([0.0] * 50 + [1.0] * 50, dtype=torch.float16)
    small = torch.tensor([2.0**-24] * 10 + [1.0] * 90, dtype=torch.float16)
    sample.add(0, None, masked, counted=True)
    sample.add(0, None, small, counted=True)
    counts = read(sample, step=2, scale=SCALE)[0].modules["layer"]
    assert counts.zeros == 50 and counts.subnormal == 10 and counts.flushed == 0


def train(mode: str, reinstall: Any, steps: int = 12, loud_at: int = 6, loud: float = 100.0) -> tuple[Any, list, Any]:
    """The aux model (a zero term in the loop) with SGD; a loud batch at step ``loud_at`` (0-based) overflows at
    4096 and above, not at torch's 1024. Returns the scaler's stats (read while its mode is installed), the scale
    of each step and the model."""
    if mode == "torch":
        scaler = stock(init_scale=1024.0, growth_interval=100)
    else:
        reinstall(AMPGUARD_UNDERFLOW=mode)
        scaler = ampguard.SafeGradScaler("cpu")
    torch.manual_seed(0)
    model = WithAux(None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scales = []
    for step in range(steps):
        x, y = data(step, loud if step == loud_at else 1.0)
        optimizer.zero_grad(set_to_none=True)
        scales.append(scaler.get_scale())
        scaler.scale(loss_of(model, x, y)).backward()
        scaler.step(optimizer)
        scaler.update()
    return getattr(scaler, "stats", None), scales, model


def test_adapt_never_grows_the_scale_for_exact_zeros_no_skip_that_off_does_not_have(reinstall, ampguard_log):
    """The issue's run: adapt against off and torch's GradScaler at ampguard's schedule. Before: adapt grew 1024 ->
    16384 over steps 2-5 for the aux head's zeros (62% "lost"), and the loud batch at step 7 was skipped."""
    stats, adapt_scales, adapt_model = train("adapt", reinstall)
    off, off_scales, off_model = train("off", reinstall)
    _, torch_scales, torch_model = train("torch", reinstall)
    assert stats.skipped == off.skipped == 0
    assert adapt_scales == off_scales == torch_scales == [1024.0] * 12
    assert same_parameters(adapt_model, off_model) and same_parameters(adapt_model, torch_model)
    assert stats.underflow_samples == 1 and stats.underflow_growths == 0 and stats.underflow_lost == 0.0
    assert not records(ampguard_log, 20, "subnormal or lost") and not records(ampguard_log, 30, "subnormal or lost")
    report, _, _ = train("report", reinstall)  # report printed the same false warning
    assert report.underflow_samples == 1 and report.underflow_lost == 0.0
    assert not records(ampguard_log, 30, "subnormal or lost")
