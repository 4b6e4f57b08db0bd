"""Lightning with a model stored in float16: its MixedPrecision plugin's GradScaler, clipping, fp32 masters.

``Trainer(precision="16-mixed")`` on CPU turns into bf16-mixed, so the plugin
is passed explicitly with ``device="cpu"`` (as in test_lightning.py); Lightning
creates the scaler, unscales, clips over ``optimizer.param_groups`` and steps.
The float16 student must reach at least 90% of the float32 student's loss
reduction; a checkpoint Lightning writes carries the masters and resumes with
``weights_only=True``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from integration_support import require

from ampguard import master_weights

L = require("lightning")
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
]

STEPS = 100
WIDTH = 32


class Student(L.LightningModule):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.teacher = torch.nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.student = torch.nn.Linear(WIDTH, WIDTH)
        with torch.no_grad():
            self.student.weight.copy_(self.teacher.weight + 3e-3 * torch.randn_like(self.teacher.weight))
            self.student.bias.copy_(self.teacher.bias + 3e-3 * torch.randn_like(self.teacher.bias))
        self.student.to(torch.float16).to(dtype)  # both start from weights float16 can hold

    def training_step(self, batch, batch_index):
        (x,) = batch
        return F.mse_loss(self.student(x).float(), self.teacher(x))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.student.parameters(), lr=1e-4)

    def held_out_loss(self) -> float:
        x = torch.randn(256, WIDTH, generator=torch.Generator().manual_seed(9))
        with torch.no_grad():
            weight, bias = self.student.weight.float(), self.student.bias.float()
            return F.mse_loss(F.linear(x, weight, bias), self.teacher(x)).item()


def _data():
    x = torch.randn(STEPS * 16, WIDTH, generator=torch.Generator().manual_seed(1))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=16)


def _fit(tmp_path, dtype: torch.dtype, *, max_steps: int = STEPS, ckpt_path=None):
    module = Student(dtype)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[MixedPrecision(precision="16-mixed", device="cpu")],
        max_steps=max_steps,
        gradient_clip_val=1.0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    start = module.held_out_loss()
    trainer.fit(module, _data(), ckpt_path=ckpt_path, weights_only=True if ckpt_path else None)
    return trainer, module, start


def test_float16_student_learns_like_float32_under_lightning(tmp_path):
    _, full, full_start = _fit(tmp_path / "fp32", torch.float32)
    trainer, half, half_start = _fit(tmp_path / "fp16", torch.float16)
    assert half.student.weight.dtype == torch.float16 and torch.isfinite(half.student.weight).all()
    assert half_start - half.held_out_loss() >= 0.9 * (full_start - full.held_out_loss()) > 0
    assert len(master_weights.masters_of(trainer.optimizers[0])) == 2
    assert trainer.precision_plugin.scaler.stats.steps == STEPS


def test_lightning_checkpoint_carries_the_masters_and_resumes(tmp_path):
    trainer, _, _ = _fit(tmp_path / "first", torch.float16, max_steps=20)
    path = tmp_path / "half.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)["optimizer_states"][0]
    assert set(saved[master_weights.STATE_KEY]) == {0, 1}
    resumed, module, _ = _fit(tmp_path / "resumed", torch.float16, max_steps=40, ckpt_path=path)
    assert resumed.global_step == 40 and torch.isfinite(module.student.weight).all()
    optimizer = resumed.optimizers[0]
    assert all(s["exp_avg_sq"].dtype == torch.float32 for s in optimizer.state.values())
