"""A coqui ``trainer`` run (the Trainer XTTS fine-tuning uses) with ampguard, small enough for a CPU.

    pip install coqui-tts-trainer        # or: pip install -e '.[integration]'
    python examples/coqui_trainer_style.py

The only ampguard line is the first import. Everything else is a plain coqui
recipe: a ``TrainerModel`` with ``train_step`` / ``get_criterion`` /
``get_data_loader``, a ``TrainerConfig`` naming the optimizer and LR scheduler,
``Trainer(...).fit()``, checkpoints every ``save_step`` steps.

On a GPU, ``mixed_precision=True`` makes the coqui Trainer build its own
``GradScaler()`` (``functools.partial(torch.GradScaler, device="cuda")``, bound
when ``trainer`` is imported): ampguard has turned that into a SafeGradScaler,
whichever of the two was imported first. On a CPU the coqui trainer runs fp32
and its CUDA scaler would disable itself, so this script keeps a scaler the way
coqui lets you without a GPU (``use_grad_scaler=True``) and points the
partial's device at "cpu". A CPU run cannot overflow fp16, so
``--overflow-steps`` makes one layer's gradient inf on the given steps: that is
what an fp16 overflow looks like to the scaler on a GPU.

The last line printed is a JSON summary: skipped steps, optimizer steps, the
loss scale, how often coqui stepped the LR scheduler.
"""

import ampguard  # noqa: I001  (first: patches torch's GradScaler before the trainer builds one)

import argparse
import functools
import json
import sys
import tempfile
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.data import DataLoader

import trainer.trainer
from trainer import Trainer, TrainerArgs, TrainerConfig, TrainerModel

VOCAB, MEL_BINS, TEXT_LEN, FRAMES = 32, 16, 12, 24


@dataclass
class TinyTTSConfig(TrainerConfig):
    run_name: str = "tiny_tts"
    steps_per_epoch: int = 16  # the data set's size, in batches
    epochs: int = 1
    batch_size: int = 4
    optimizer: str = "AdamW"
    optimizer_params: dict = field(default_factory=lambda: {"betas": [0.9, 0.96], "weight_decay": 1e-2})
    lr: float = 5e-3
    lr_scheduler: str = "MultiStepLR"
    lr_scheduler_params: dict = field(default_factory=lambda: {"milestones": [6, 12], "gamma": 0.5})
    scheduler_after_epoch: bool = False
    mixed_precision: bool = torch.cuda.is_available()  # fp16 autocast + the trainer's own scaler on a GPU
    precision: str = "fp16"
    use_grad_scaler: bool = True  # keeps a scaler on a CPU too (fp32 there)
    grad_clip: float = 1.0  # unscale_, then clip_grad_norm_
    run_eval: bool = False
    save_step: int = 8
    save_best_after: int = 1_000_000
    print_step: int = 4
    dashboard_logger: str = "tensorboard"


class TinyTTS(TrainerModel):
    """Text tokens in, mel frames out: embedding, a GRU, a linear decoder."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 32)
        self.encoder = nn.GRU(32, 32, batch_first=True)
        self.decoder = nn.Linear(32, MEL_BINS * 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        hidden, _ = self.encoder(self.embedding(tokens))
        mel = self.decoder(hidden).view(tokens.shape[0], TEXT_LEN * 2, MEL_BINS)
        return mel[:, :FRAMES]

    def train_step(self, batch, criterion, optimizer_idx=None):  # type: ignore[override]
        mel = self(batch["tokens"])
        return {"model_outputs": mel}, {"loss": criterion(mel, batch["mel"])}

    def get_criterion(self) -> nn.Module:
        return nn.L1Loss()

    def get_data_loader(self, config, *, is_eval=False, samples=None, verbose=True):  # type: ignore[override]
        generator = torch.Generator().manual_seed(0)
        count = config.batch_size * config.steps_per_epoch
        tokens = torch.randint(0, VOCAB, (count, TEXT_LEN), generator=generator)
        mel = torch.randn(count, FRAMES, MEL_BINS, generator=generator)
        items = [{"tokens": t, "mel": m} for t, m in zip(tokens, mel)]
        return DataLoader(items, batch_size=config.batch_size, shuffle=False)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps (one epoch)")
    parser.add_argument("--overflow-steps", default="3,9", help="1-based steps whose gradients are made inf")
    parser.add_argument("--output-path", default=None, help="default: a temporary folder")
    args = parser.parse_args(argv)
    overflow_steps = {int(s) for s in args.overflow_steps.split(",") if s.strip()}

    if not torch.cuda.is_available():
        # What Trainer.__init__ calls, on "cpu" instead of "cuda" (the class is whatever torch's is now).
        current = trainer.trainer.GradScaler
        trainer.trainer.GradScaler = functools.partial(
            current.func, *current.args, **{**current.keywords, "device": "cpu"}
        )

    torch.manual_seed(0)
    model = TinyTTS()
    output = args.output_path or tempfile.mkdtemp(prefix="coqui_trainer_style_")
    config = TinyTTSConfig(output_path=output, steps_per_epoch=args.steps)
    coqui = Trainer(TrainerArgs(), config, model=model, parse_command_line_args=False)

    backward_passes = 0

    def simulate_fp16_overflow(grad: torch.Tensor):
        nonlocal backward_passes
        backward_passes += 1
        return torch.full_like(grad, float("inf")) if backward_passes in overflow_steps else None

    model.decoder.weight.register_hook(simulate_fp16_overflow)
    coqui.fit()

    stats = coqui.scaler.stats
    summary = {
        "client": "coqui-trainer",
        "scaler": type(coqui.scaler).__name__,
        "skipped": stats.skipped,
        "steps": stats.steps,
        "scale": stats.scale,
        "lr_scheduler_steps": coqui.scheduler[0].last_epoch,
        "ampguard": ampguard.__version__,
    }
    print(
        f"coqui trainer: {stats.skipped} of {stats.steps} optimizer steps skipped (overflow), loss scale now {stats.scale:g}"
    )
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
