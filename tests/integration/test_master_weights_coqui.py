"""The coqui trainer with a model stored in float16: its own GradScaler, clipping and checkpoints, fp32 masters.

The trainer is built as in test_coqui_trainer.py (its ``GradScaler()`` line,
with the partial's device re-pointed to "cpu"), with AdamW and
``grad_clip=1.0`` (``scaler.unscale_`` then ``clip_grad_norm_`` over a
generator of the parameters). The model's forward casts its input to the
weights' dtype, as a model loaded in float16 does.
"""

from __future__ import annotations

import glob

import pytest
import torch
from integration_support import require

from ampguard import master_weights

require("trainer")
import coqui_tiny  # noqa: E402
import trainer.trainer  # noqa: E402
from trainer import Trainer, TrainerArgs  # noqa: E402

pytestmark = pytest.mark.integration

EPOCHS = 3
STEPS = EPOCHS * coqui_tiny.SAMPLES // coqui_tiny.TinyConfig.batch_size


class WeightsDtypeModel(coqui_tiny.TinyModel):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.net(x.to(self.net[0].weight.dtype)).float()


def _fit(output_path, dtype: torch.dtype) -> Trainer:
    torch.manual_seed(0)
    model = WeightsDtypeModel().to(torch.float16).to(dtype)  # the same start for both dtypes
    previous = trainer.trainer.GradScaler
    trainer.trainer.GradScaler = coqui_tiny.cpu_grad_scaler_factory()
    try:
        coqui = Trainer(
            TrainerArgs(),
            coqui_tiny.TinyConfig(
                output_path=str(output_path), optimizer="AdamW", lr=1e-3, grad_clip=1.0, epochs=EPOCHS
            ),
            model=model,
            parse_command_line_args=False,
        )
    finally:
        trainer.trainer.GradScaler = previous
    coqui.fit()
    return coqui


def test_float16_model_trains_like_float32_and_checkpoints_carry_the_masters(tmp_path):
    full = _fit(tmp_path / "fp32", torch.float32)
    half = _fit(tmp_path / "fp16", torch.float16)
    assert all(p.dtype == torch.float16 and torch.isfinite(p).all() for p in half.model.parameters())
    [optimizer] = half.optimizer if isinstance(half.optimizer, list) else [half.optimizer]
    assert len(master_weights.masters_of(optimizer)) == 4
    assert half.scaler.stats.steps == full.scaler.stats.steps == STEPS
    assert half.keep_avg_train["avg_loss"] == pytest.approx(full.keep_avg_train["avg_loss"], rel=0.01)
    for ours, theirs in zip(half.model.parameters(), full.model.parameters()):
        torch.testing.assert_close(ours.float(), theirs, atol=2e-3, rtol=0)
    [checkpoint_path] = sorted(glob.glob(str(tmp_path / "fp16" / "**" / "checkpoint_*.pth"), recursive=True))[-1:]
    checkpoint = torch.load(checkpoint_path, weights_only=True)
    saved = checkpoint["optimizer"]
    saved = saved[0] if isinstance(saved, list) else saved  # the coqui trainer saves a list of optimizers
    assert set(saved[master_weights.STATE_KEY]) == {0, 1, 2, 3}
    assert all(t.dtype == torch.float32 for t in saved[master_weights.STATE_KEY].values())
