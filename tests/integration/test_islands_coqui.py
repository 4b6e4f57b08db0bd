"""fp32 islands inside the coqui ``trainer`` (what XTTS fine-tuning runs): an overflowing block healed.

The model is the multi-block attention net of tests/support/islands_support.py, whose
``blocks.1.attn`` overflows float16 on the overflowing batches (here every 3rd);
the coqui Trainer runs it under its own ``torch.autocast`` (``mixed_precision``;
float16 as on CUDA, see the test) and builds its scaler with its own
``GradScaler()`` line (see coqui_tiny.py).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from integration_support import require
from torch import nn
from torch.utils.data import DataLoader

require("trainer")
import coqui_tiny  # noqa: E402
import islands_support  # noqa: E402
from islands_support import fresh_islands  # noqa: E402, F401  (fixture)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("fresh_islands")]

STEPS = 12
OVERFLOWING = {2, 5, 8, 11}


class OverflowingModel(coqui_tiny.TinyModel):
    def __init__(self) -> None:
        super().__init__()
        self.net = islands_support.make_net()

    def train_step(self, batch: dict[str, Any], criterion: nn.Module, optimizer_idx: int | None = None):  # type: ignore[override]
        out = self(batch["x"])  # TinyModel.forward: self.net(x)
        return {"model_outputs": out}, {"loss": criterion(out, batch["y"])}

    def get_criterion(self) -> nn.Module:
        return nn.CrossEntropyLoss()

    def get_data_loader(self, config: Any, *, is_eval: bool = False, samples: Any = None, verbose: bool = True):  # type: ignore[override]
        rows = []
        for step in range(STEPS):
            x, y = islands_support.batch(step, healthy=True)
            if step in OVERFLOWING:
                x = x * 8.0
            rows += [{"x": a, "y": b} for a, b in zip(x, y)]
        return DataLoader(rows, batch_size=islands_support.BATCH)


def test_coqui_trainer_names_and_heals_the_overflowing_block(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(coqui_tiny, "TinyModel", OverflowingModel)
    # On CUDA with precision="fp16" coqui autocasts to float16; on CPU it forces bfloat16. The CPU
    # stand-in: the autocast arguments the CUDA path returns, on the CPU device.
    monkeypatch.setattr(coqui_tiny.Trainer, "_get_autocast_args", lambda self, **_: ("cpu", torch.float16))
    monkeypatch.setattr(logging.getLogger("ampguard"), "propagate", True)
    caplog.set_level(logging.INFO, logger="ampguard")
    # On CPU coqui keeps a scaler for mixed precision only through use_grad_scaler when precision is not "fp16".
    coqui = coqui_tiny.build_trainer(tmp_path, mixed_precision=True, precision="bf16", lr=0.01)
    coqui.fit()
    stats = coqui.scaler.stats
    assert coqui.total_steps_done == STEPS
    assert stats.fp32_islands == ("net.blocks.1.attn",)
    # batch 2, named there from what the headroom watch of step 2 saw; 5, 8 and 11 train in float32
    assert stats.skipped == stats.nonfinite_loss == 1
    assert stats.min_scale_seen == 1024.0
    made = {r.getMessage() for r in caplog.records if r.getMessage().startswith("fp32 island:")}
    assert len(made) == 1 and made.pop().startswith("fp32 island: net.blocks.1.attn (Attention)")
    assert all(torch.isfinite(p).all() for p in coqui.model.parameters())
