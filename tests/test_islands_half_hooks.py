"""Fp32 islands of float16/bfloat16-parameter modules, judged against the same module without the island."""

from __future__ import annotations

import warnings

import pytest
import torch
from islands_support import fresh_islands  # noqa: F401  (fixture)
from scaler_support import one_thread  # noqa: F401  (fixture)
from torch import nn

from ampguard.fp32_islands import islands

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_islands")


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
    islands.make(module, "conv", outputs=("autocast",))
    with torch.autocast("cpu", dtype=torch.float16):
        out = module(x)  # ampguard: RuntimeError: self and mat2 must have the same dtype, but got Float and Half
    assert out.dtype == expected.dtype and torch.allclose(out.float(), expected.float(), atol=1e-2)
