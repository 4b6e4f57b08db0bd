"""A tiny coqui ``trainer`` model and config, the shape XTTS fine-tuning has: a
``TrainerModel`` with ``train_step`` / ``get_criterion`` / ``get_data_loader``,
the optimizer and LR scheduler named in the config, dict batches.

This module does not import ampguard, so that an import-order test can import
``trainer`` (and this module) first and ampguard afterwards.
"""

# No "from __future__ import annotations": coqpit reads the config's field types at run time.
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import trainer.trainer
from torch import nn
from torch.utils.data import DataLoader
from trainer import Trainer, TrainerArgs, TrainerConfig, TrainerModel

SAMPLES = 32


@dataclass
class TinyConfig(TrainerConfig):
    epochs: int = 1
    batch_size: int = 4  # 8 steps an epoch
    optimizer: str = "SGD"
    lr: float = 0.05
    lr_scheduler: str = "StepLR"
    lr_scheduler_params: dict = field(default_factory=lambda: {"step_size": 1, "gamma": 0.9})
    scheduler_after_epoch: bool = False  # stepped after every optimizer step: skip detection matters
    # What XTTS users set for AMP; on CPU the coqui trainer only keeps a scaler through this flag
    # (mixed_precision + fp16 yields a scaler only with CUDA).
    use_grad_scaler: bool = True
    run_eval: bool = False
    save_step: int = 5
    save_best_after: int = 1_000_000  # only checkpoint_<step>.pth: continue_path restores the one we check
    print_step: int = 1000
    dashboard_logger: str = "tensorboard"
    training_seed: int = 1234


class TinyModel(TrainerModel):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.net(x)

    def train_step(self, batch: dict[str, Any], criterion: nn.Module, optimizer_idx: int | None = None):  # type: ignore[override]
        out = self(batch["x"])
        return {"model_outputs": out}, {"loss": criterion(out, batch["y"])}

    def get_criterion(self) -> nn.Module:
        return nn.MSELoss()

    def get_data_loader(
        self, config: TrainerConfig, *, is_eval: bool = False, samples: Any = None, verbose: bool = True
    ):  # type: ignore[override]
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(SAMPLES, 8, generator=generator)
        y = torch.randn(SAMPLES, 1, generator=generator)
        return DataLoader([{"x": a, "y": b} for a, b in zip(x, y)], batch_size=config.batch_size)


def cpu_grad_scaler_factory() -> functools.partial:
    """What ``trainer.trainer.GradScaler`` creates, with ``device="cpu"`` instead of ``"cuda"``.

    The coqui trainer binds ``GradScaler = functools.partial(torch.GradScaler, device="cuda")``
    at import and calls ``GradScaler()`` in ``Trainer.__init__``; on a machine
    without CUDA that scaler disables itself. Re-pointing only the device keeps
    the class the partial holds now (SafeGradScaler once ampguard rebound it,
    torch's class without ampguard) and the Trainer's own construction line.
    """
    current = trainer.trainer.GradScaler
    assert isinstance(current, functools.partial), current
    return functools.partial(current.func, *current.args, **{**current.keywords, "device": "cpu"})


def build_trainer(
    output_path: Path | str,
    *,
    continue_path: str = "",
    seed: int = 0,
    scaler_factory: Any = None,
    model_factory: Any = None,
    config_class: Any = None,
    **config: Any,
) -> Trainer:
    """A coqui Trainer on CPU whose own ``GradScaler()`` line makes a working CPU scaler.

    ``scaler_factory`` replaces :func:`cpu_grad_scaler_factory` (e.g. torch's own class for a
    comparison run); ``model_factory`` and ``config_class`` replace :class:`TinyModel` and
    :class:`TinyConfig` (another recipe).
    """
    torch.manual_seed(seed)
    model = (model_factory or TinyModel)()
    previous = trainer.trainer.GradScaler
    trainer.trainer.GradScaler = scaler_factory or cpu_grad_scaler_factory()
    try:
        return Trainer(
            TrainerArgs(continue_path=continue_path),
            (config_class or TinyConfig)(output_path=str(output_path), **config),
            model=model,
            parse_command_line_args=False,
        )
    finally:
        trainer.trainer.GradScaler = previous


def params_of(coqui_trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in coqui_trainer.model.parameters()]


@dataclass
class TinyGANConfig(TinyConfig):
    """Two optimizers sharing the one scaler, one ``update()`` after the last (coqui's GAN path)."""

    grad_clip: list = field(default_factory=lambda: [0.0, 0.0])


class TinyGAN(TrainerModel):
    """coqui's GAN recipe (its own tests' shape): optimizer 0 the discriminator, 1 the generator."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.generator(x)

    def train_step(self, batch: dict[str, Any], criterion: nn.Module, optimizer_idx: int | None = None):  # type: ignore[override]
        real, noise = batch["x"], batch["x"][:, :4]
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        if optimizer_idx == 0:
            fake = self.generator(noise).detach()
            loss = (criterion(self.discriminator(real), ones) + criterion(self.discriminator(fake), zeros)) / 2
            return {"model_outputs": fake}, {"loss": loss}
        fake = self.generator(noise)
        return {"model_outputs": fake}, {"loss": criterion(self.discriminator(fake), ones)}

    def get_optimizer(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.Adam(self.discriminator.parameters(), lr=1e-3, betas=(0.5, 0.999)),
            torch.optim.Adam(self.generator.parameters(), lr=1e-3, betas=(0.5, 0.999)),
        ]

    def get_scheduler(self, optimizer: list[torch.optim.Optimizer]) -> list[Any]:
        return [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.9) for o in optimizer]

    def get_criterion(self) -> nn.Module:
        return nn.BCEWithLogitsLoss()

    def get_data_loader(
        self, config: TrainerConfig, *, is_eval: bool = False, samples: Any = None, verbose: bool = True
    ):  # type: ignore[override]
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(SAMPLES, 8, generator=generator)
        return DataLoader([{"x": a} for a in x], batch_size=config.batch_size)


def build_gan_trainer(output_path: Path | str, *, scaler_factory: Any = None) -> Trainer:
    torch.manual_seed(0)
    model = TinyGAN()
    previous = trainer.trainer.GradScaler
    trainer.trainer.GradScaler = scaler_factory or cpu_grad_scaler_factory()
    try:
        return Trainer(
            TrainerArgs(), TinyGANConfig(output_path=str(output_path)), model=model, parse_command_line_args=False
        )
    finally:
        trainer.trainer.GradScaler = previous
