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


def _trainer(tmp_path, max_steps: int, **precision) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        **precision,
    )


def _fit(tmp_path, dtype: torch.dtype, *, max_steps: int = STEPS, ckpt_path=None):
    module = Student(dtype)
    plugin = MixedPrecision(precision="16-mixed", device="cpu")
    trainer = _trainer(tmp_path, max_steps, plugins=[plugin], gradient_clip_val=1.0)
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


# -- precision="16-true": the whole model in float16, no scaler, optimizer.step(closure=...) ------------------


class TrueHalfStudent(L.LightningModule):
    """Student's student alone: Lightning's HalfPrecision plugin turns the module and the batches into float16.

    The targets come from Student's float32 teacher, outside the module (in the data and the held-out loss),
    so the float16 and the float32 run are fitted to the same numbers.
    """

    def __init__(self) -> None:
        super().__init__()
        self.student = Student(torch.float32).student  # float16-representable start

    def training_step(self, batch, batch_index):
        x, y = batch
        return F.mse_loss(self.student(x).float(), y.float())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.student.parameters(), lr=1e-4)


def _fit_true_precision(tmp_path, precision: str) -> tuple[L.Trainer, TrueHalfStudent, float, float]:
    """Train under ``Trainer(precision=...)``: the held-out loss of the weights (in float32) before and after."""
    judge = Student(torch.float32)  # its teacher makes the targets and judges the student's weights

    def held_out_loss(module: TrueHalfStudent) -> float:
        judge.student = module.student
        return judge.held_out_loss()

    x = torch.randn(STEPS * 16, WIDTH, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        data = torch.utils.data.TensorDataset(x, judge.teacher(x))
    module = TrueHalfStudent()
    start = held_out_loss(module)
    trainer = _trainer(tmp_path, STEPS, precision=precision)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=16))
    return trainer, module, start, held_out_loss(module)


def test_16_true_adamw_trains_like_float32(tmp_path):
    """``precision="16-true"`` steps with ``optimizer.step(closure=...)``: the float16 model gets masters, learns."""
    *_, full_start, full_end = _fit_true_precision(tmp_path / "fp32", "32-true")
    trainer, half, half_start, half_end = _fit_true_precision(tmp_path / "fp16", "16-true")
    assert half.student.weight.dtype == torch.float16 and torch.isfinite(half.student.weight).all()
    assert len(master_weights.masters_of(trainer.optimizers[0])) == 2
    assert half_start == full_start and full_start - full_end > 0
    assert half_start - half_end == pytest.approx(full_start - full_end, rel=0.02)
