"""fp32 islands in a model stored in float16 and trained without autocast (``model.half()``, float32 masters).

Such a model has no autocast for an island to switch off: the island itself casts the half-precision inputs,
parameters and buffers to float32 for the call and gives its outputs back in float16. Judged against plain torch
running the same float32-master loop (every loud batch lost) and against a float32 copy of the module.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from islands_support import (  # noqa: F401
    DIM,
    HALF_STEPS,
    Net,
    ampguard_loop,
    applied_islands,
    batch,
    fresh_islands,
    half_net,
    overflows,
    probe_only,
)
from scaler_support import ampguard_log, one_thread, records  # noqa: F401  (fixtures)
from test_islands_half import SharedAndNormed
from torch import nn

import ampguard

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_islands")


def master_loop(model: nn.Module) -> list[int]:
    """Plain torch's float16 recipe without autocast: float32 masters, a static loss scale, a step skipped when a
    gradient is inf/NaN. The steps whose loss was inf/NaN."""
    masters = [p.detach().float().requires_grad_() for p in model.parameters()]
    optimizer = torch.optim.AdamW(masters, lr=1e-3)
    lost = []
    for step in range(HALF_STEPS):
        x, y = batch(step)
        model.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x.half()).float(), y)
        (loss * 1024.0).backward()
        grads = [p.grad.float() / 1024.0 for p in model.parameters()]
        if not torch.isfinite(loss):
            lost.append(step)
        if not all(torch.isfinite(g).all() for g in grads):
            continue
        for master, grad in zip(masters, grads, strict=True):
            master.grad = grad
        optimizer.step()
        with torch.no_grad():
            for p, master in zip(model.parameters(), masters, strict=True):
                p.copy_(master)
    return lost


@pytest.mark.usefixtures("probe_only")
def test_a_float16_model_without_autocast_loses_at_most_two_steps_where_plain_torch_loses_every_loud_batch(
    ampguard_log,
):
    """With the probe alone (the headroom watch's case: tests/headroom_watch/test_headroom_watch_models.py, one step lost)."""
    with torch.no_grad():
        assert torch.isfinite(half_net()(batch(9)[0])).all()  # in float32 the loud batch is harmless
    ampguard.uninstall()
    plain = half_net().half()
    assert master_loop(plain) == [step for step in range(HALF_STEPS) if overflows(step)]  # plain torch: all 3 lost
    ampguard.install()

    model = half_net().half()
    lost, scaler = ampguard_loop(model)
    assert scaler.stats.fp32_islands == ("blocks.1.attn",)
    assert lost == [9, 19]  # the probe arms at the first loud batch and names the block at the second
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # The island computes what a float32 copy of it computes, given back in float16 (what the next block expects).
    attn = model.blocks[1].attn
    hidden = torch.randn(4, 6, DIM).half() * 30.0
    with torch.no_grad():
        out, expected = attn(hidden), copy.deepcopy(attn).float()(hidden.float())
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    assert torch.equal(out, expected.half())
    applied_islands().clear()
    with torch.no_grad():
        assert not torch.isfinite(attn(hidden)).all()  # (without the island it overflows)
    # The printed line, on a fresh float16 model (no island): that block in float32, float16 around it, finite.
    made = records(ampguard_log, logging.WARNING, "fp32 island: blocks.1.attn (Attention)")[0].getMessage()
    assert "the model runs without autocast" in made and "its float16 parameters stay float16" in made
    fresh = half_net().half()
    exec(made.split("(model: your Net): ")[1], {"model": fresh, "torch": torch})
    with torch.no_grad():
        assert fresh(batch(9)[0].half()).dtype == torch.float16
        assert torch.isfinite(fresh(batch(9)[0].half())).all() and not torch.isfinite(plain(batch(9)[0].half())).all()


def test_without_autocast_the_gradients_and_buffer_updates_reach_the_float16_tensors():
    torch.manual_seed(0)
    module = SharedAndNormed().half()
    reference = copy.deepcopy(module).float()
    weight, running_mean = module.a.weight, module.norm.running_mean
    applied_islands().make(
        module, "shared"
    )  # made by name: no output dtypes recorded, float32 outputs go back to float16
    x = torch.randn(8, DIM) * 30.0  # 1000 * x @ W.T passes 65504: float16 overflows, float32 does not
    out = module(x.half())
    expected = reference(x.half().float())
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    assert torch.equal(out, expected.half())
    assert module.seen == [(torch.float32, True)]  # one float32 copy of the shared weight
    assert module.a.weight is weight and weight.dtype == torch.float16
    assert module.norm.running_mean is running_mean and running_mean.dtype == torch.float16
    assert torch.equal(running_mean, reference.norm.running_mean.half())
    out.float().pow(2).mean().backward()
    expected.pow(2).mean().backward()
    assert weight.grad is not None and weight.grad.dtype == torch.float16
    assert torch.allclose(weight.grad.float(), reference.a.weight.grad, rtol=1e-2, atol=1e-3)
    # A float32 module called without autocast has nothing in half precision: it runs as it is.
    plain = nn.Linear(DIM, DIM)
    applied_islands().make(plain, "plain")
    assert plain(x).dtype == torch.float32
