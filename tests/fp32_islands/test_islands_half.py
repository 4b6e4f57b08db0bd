"""fp32 islands of modules whose parameters are float16 or bfloat16 (a model loaded with ``.half()``).

The activations overflow, not the weights: the island computes the module in
float32 with its parameters upcast for each call, and the model keeps its
half-precision parameters (their identity, dtype, state dict, and the
optimizer's hold on them; their float32 masters get the gradients).
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
from islands_support import (  # noqa: F401
    BATCH,
    CLASSES,
    DIM,
    EVERY,
    TOKENS,
    Net,
    applied_islands,
    fresh_islands,
    overflows,
)
from scaler_support import (  # noqa: F401  (fixtures)
    ampguard_log,
    one_thread,
    records,
)
from torch import nn

import ampguard

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_islands")

STEPS = 200  # 20 loud batches
LOUD = 4.0  # every 10th batch: block 1's attention logits pass 65504 (16x), the others' peak stays below ~27,000
SHARPNESS = 88.0
TEACHER = torch.randn(DIM, CLASSES, generator=torch.Generator().manual_seed(7))


def loud_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, TOKENS, DIM, generator=gen)
    labels = (x.mean(1) @ TEACHER).argmax(-1)  # learnable: a fixed projection of the tokens' mean
    return (x * LOUD if overflows(step) else x), labels


def two_blocks() -> Net:
    torch.manual_seed(0)
    return Net(blocks=2, hot=1, sharpness=SHARPNESS)


def recipe(model: nn.Module, *, half: bool) -> tuple[int, torch.optim.Optimizer, torch.amp.GradScaler]:
    """torch's recipe loop (fp16 autocast, unscale_, clip, step, update) or, ``half=False``, plain float32."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=100, enabled=half)
    lost = 0
    for step in range(STEPS):
        x, y = loud_batch(step)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16, enabled=half):
            loss = nn.functional.cross_entropy(model(x), y)
        lost += not bool(torch.isfinite(loss))
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
    return lost, optimizer, scaler


def evaluation_loss(model: nn.Module) -> float:
    """The trained model's loss in float32 over 40 batches (ordinary and loud ones)."""
    model = copy.deepcopy(model).float()
    with torch.no_grad():
        return sum(float(nn.functional.cross_entropy(model(x), y)) for x, y in map(loud_batch, range(1000, 1040))) / 40


def test_a_model_loaded_in_float16_gets_its_overflowing_attention_block_as_an_island(ampguard_log):
    model = two_blocks().half()
    params = list(model.parameters())
    state = {key: (value.dtype, value.shape) for key, value in model.state_dict().items()}
    lost, optimizer, scaler = recipe(model, half=True)

    assert lost <= 3  # the probe arms at the first loud batch and names the block at the second (before: all 20)
    assert applied_islands().names() == ("blocks.1.attn",)
    made = records(ampguard_log, logging.WARNING, "fp32 island: blocks.1.attn (Attention)")
    assert len(made) == 1 and "its float16 parameters stay float16" in made[0].getMessage()
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))  # the same Parameters, still float16
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    assert optimizer.param_groups[0]["params"] == params  # the optimizer steps them
    assert {key: (value.dtype, value.shape) for key, value in model.state_dict().items()} == state
    assert all(torch.isfinite(p).all() for p in params)
    # A loud batch now trains the island: its float16 gradients reach the float32 masters, which step.
    masters = {id(p): master for p, master in ampguard.master_weights.masters_of(optimizer)}
    weight = model.blocks[1].attn.v.weight  # (q and k get none where the loud logits saturate the softmax)
    before = masters[id(weight)].clone()
    optimizer.zero_grad(set_to_none=True)
    x, y = loud_batch(EVERY - 1)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    assert torch.isfinite(loss) and weight.grad is not None and weight.grad.dtype == torch.float16
    assert torch.isfinite(masters[id(weight)].grad).all() and masters[id(weight)].grad.abs().sum() > 0
    scaler.step(optimizer)
    scaler.update()
    assert not torch.equal(masters[id(weight)], before) and torch.equal(weight, masters[id(weight)].half())

    reference = two_blocks()
    reference_lost, _, _ = recipe(reference, half=False)
    assert reference_lost == 0
    trained, expected = evaluation_loss(model), evaluation_loss(reference)
    assert abs(trained - expected) <= 0.1 * expected, (trained, expected)
    assert expected < 0.8 * evaluation_loss(two_blocks())  # measured: 0.945 against 1.448 untrained


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_block_in_a_float32_model_becomes_an_island(ampguard_log, dtype):
    """One block in float16 or bfloat16, the rest float32 (whose modules are islanded as before, untouched)."""
    model = two_blocks()
    attn = model.blocks[1].attn.to(dtype)
    lost, _, _ = recipe(model, half=True)
    assert lost <= 3 and applied_islands().names() == ("blocks.1.attn",)
    name = str(dtype).replace("torch.", "")
    made = records(ampguard_log, logging.WARNING, "fp32 island: blocks.1.attn (Attention)")[0].getMessage()
    assert f"its {name} parameters stay {name}" in made and "m.float(); m.forward = " in made
    assert {p.dtype for p in attn.parameters()} == {dtype}
    assert {p.dtype for p in model.blocks[0].parameters()} == {torch.float32}
    # In float32 with the block's weights as they are: what a float32 copy of it computes, given back in float16.
    hidden = loud_batch(EVERY - 1)[0]
    reference = copy.deepcopy(attn).float()
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.float16):
            island = attn(hidden)
        expected = reference(hidden)
    assert island.dtype == torch.float16 and torch.isfinite(island).all()
    assert torch.equal(island, expected.half())
    # The printed line, on a fresh model of the same kind (no island): its weights kept in float32, finite.
    fresh = two_blocks()
    fresh.blocks[1].attn.to(dtype)
    exec(made.split("(model: your Net): ")[1], {"model": fresh, "torch": torch})
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        assert torch.isfinite(fresh(hidden)).all() and not torch.isfinite(two_blocks().half()(hidden)).all()


class SharedAndNormed(nn.Module):
    """Two projections sharing one weight, a BatchNorm (running statistics), and a check of what forward sees."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM, bias=False)
        self.b.weight = self.a.weight
        self.norm = nn.BatchNorm1d(DIM)
        self.seen: list[tuple[torch.dtype, bool]] = []
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((self.a.weight.dtype, self.a.weight is self.b.weight))
        if self.fail:
            raise ValueError("the forward raised")
        return self.norm(self.a(x) + self.b(x) * 1000.0)


def test_an_island_reads_float32_copies_and_the_gradients_and_buffer_updates_reach_the_half_precision_tensors():
    torch.manual_seed(0)
    module = SharedAndNormed().half()
    reference = copy.deepcopy(module).float()
    weight, running_mean = module.a.weight, module.norm.running_mean
    applied_islands().make(module, "shared", outputs=("autocast",))
    x = torch.randn(8, DIM) * 30.0  # 1000 * x @ W.T passes 65504: float16 overflows, float32 does not
    with torch.autocast("cpu", dtype=torch.float16):
        out = module(x)
    expected = reference(x)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    assert torch.equal(out, expected.half())
    assert module.seen == [(torch.float32, True)]  # one float32 copy of the shared weight
    assert module.a.weight is weight and module.b.weight is weight and weight.dtype == torch.float16
    assert all(isinstance(p, nn.Parameter) and p.dtype == torch.float16 for p in module.parameters())
    # The running statistics were updated in float32 and written back into the float16 buffer (the same tensor).
    assert module.norm.running_mean is running_mean and running_mean.dtype == torch.float16
    assert torch.equal(running_mean, reference.norm.running_mean.half())
    assert int(module.norm.num_batches_tracked) == 1
    # The gradient reaches the float16 parameter: the sum over both of its uses, computed in float32.
    out.float().pow(2).mean().backward()
    expected.pow(2).mean().backward()
    assert weight.grad is not None and weight.grad.dtype == torch.float16
    assert torch.allclose(weight.grad.float(), reference.a.weight.grad, rtol=1e-2, atol=1e-3)
    # A forward that raises leaves the model's own tensors in place.
    module.fail = True
    with pytest.raises(ValueError), torch.autocast("cpu", dtype=torch.float16):
        module(x)
    assert module.a.weight is weight and module.norm.running_mean is running_mean
    assert module.seen[-1] == (torch.float32, True)


# -- fp32 islands of float16/bfloat16-parameter modules, judged against the same module without the island. ------------


def _old_weight_norm(module: nn.Module) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated, still what coqui's vocoders (HiFiGAN) use
        return nn.utils.weight_norm(module)


@pytest.mark.parametrize("norm", [_old_weight_norm, nn.utils.spectral_norm], ids=["weight_norm", "spectral_norm"])
def test_a_half_island_with_a_hook_computed_weight_runs_as_without_the_island(norm):
    """torch.nn.utils.weight_norm/spectral_norm compute ``weight`` (a plain attribute) from the float16 parameters in
    a forward pre-hook that runs before the island's: inside the island it stays float16 while the input is float32,
    and the forward raises (without the island it runs)."""
    torch.manual_seed(0)
    module = norm(nn.Linear(8, 8)).half().eval()  # (in training, spectral_norm's power iteration moves each call)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.float16):
        expected = module(x)
    applied_islands().make(module, "conv", outputs=("autocast",))
    with torch.autocast("cpu", dtype=torch.float16):
        out = module(x)  # ampguard: RuntimeError: self and mat2 must have the same dtype, but got Float and Half
    assert out.dtype == expected.dtype and torch.allclose(out.float(), expected.float(), atol=1e-2)
