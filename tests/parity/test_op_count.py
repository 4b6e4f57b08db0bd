"""Kernels per optimizer step: ampguard adds at most 4 aten ops to torch's recipe step, plain and fused.

On a GPU every aten op is a kernel launch of a few microseconds, which is what
a step-time ratio on a small model shows first. The ops are counted with a
dispatch mode (deterministic; no time is measured) over the recipe step
(``scale``, ``backward``, ``unscale_``, ``clip_grad_norm_``, ``step``, ``update``),
for torch's GradScaler and clip and for ampguard's, on the same model and data.
docs/performance.md lists which ops they are.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from clip_support import clip_state
from torch.utils._python_dispatch import TorchDispatchMode

import ampguard
import ampguard.scaler

MAX_EXTRA_OPS = 4
WARMUP, COUNTED = 3, 5


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.by_op[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


def _fused_adamw_on_cpu() -> bool:
    try:
        parameter = torch.nn.Parameter(torch.zeros(2))
        parameter.grad = torch.zeros(2)
        torch.optim.AdamW([parameter], fused=True).step()
    except (RuntimeError, ValueError, TypeError):
        return False
    return True


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def _ops_per_step(scaler_class: type, clip_grad_norm_: Callable[..., torch.Tensor], fused: bool) -> Counter[str]:
    model = copy.deepcopy(_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **({"fused": True} if fused else {}))
    scaler = scaler_class("cpu", init_scale=1024.0, growth_interval=100)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)) for _ in range(4)]

    def step(index: int) -> None:
        inputs, targets = batches[index % len(batches)]
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(inputs).float(), targets)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()

    for index in range(WARMUP):  # lazy state (optimizer moments, scale tensors) out of the way
        step(index)
    with _Ops() as ops:
        for index in range(WARMUP, WARMUP + COUNTED):
            step(index)
    assert scaler.get_scale() == 1024.0  # healthy steps only: the path every step takes
    return Counter({name: count // COUNTED for name, count in ops.by_op.items() if count % COUNTED == 0}) + Counter(
        {f"{name} (uneven)": count for name, count in ops.by_op.items() if count % COUNTED}
    )


def _extra_ops(fused: bool) -> tuple[int, dict[str, int]]:
    assert issubclass(torch.amp.GradScaler, ampguard.SafeGradScaler)  # conftest: ampguard installed, defaults
    torch_ops = _ops_per_step(ampguard.scaler.TorchGradScaler, clip_state().original, fused)
    ours = _ops_per_step(torch.amp.GradScaler, torch.nn.utils.clip_grad_norm_, fused)
    extra = ours.copy()
    extra.subtract(torch_ops)
    return sum(ours.values()) - sum(torch_ops.values()), {name: n for name, n in sorted(extra.items()) if n}


@pytest.fixture(autouse=True)
def _fresh_installation(reinstall):
    """A probe armed, or islands made, by an earlier test in this process would add their own ops."""
    reinstall()


def test_plain_adamw_step_adds_at_most_four_ops():
    extra, which = _extra_ops(fused=False)
    assert 0 <= extra <= MAX_EXTRA_OPS, which
    assert not any("uneven" in name for name in which), which  # the same ops every healthy step


@pytest.mark.skipif(not _fused_adamw_on_cpu(), reason="AdamW(fused=True) on the CPU needs a newer torch")
def test_fused_adamw_step_adds_at_most_four_ops():
    extra, which = _extra_ops(fused=True)
    assert 0 <= extra <= MAX_EXTRA_OPS, which
    assert not any("uneven" in name for name in which), which
