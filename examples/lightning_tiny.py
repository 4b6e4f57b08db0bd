"""A Lightning run in fp16 mixed precision with ampguard, small enough for a CPU.

    pip install lightning       # or: pip install -e '.[integration]'
    python examples/lightning_tiny.py

The only ampguard line is the first import. Lightning's ``MixedPrecision``
plugin creates ``torch.amp.GradScaler(device=...)`` itself: with ampguard
imported that is a SafeGradScaler. On a GPU ``Trainer(precision="16-mixed")``
is all it takes; on a CPU Lightning turns "16-mixed" into "bf16-mixed" (no
scaler), so this script passes the plugin with ``device="cpu"``. A CPU run cannot
be relied on to overflow fp16, so ``--overflow-steps`` makes one layer's gradient
inf on the given steps: what an fp16 overflow looks like to the scaler on a GPU.

The last line printed is a JSON summary with the skipped-step count.
"""

import ampguard  # noqa: I001  (first: patches torch's GradScaler before Lightning builds one)

import argparse
import json
import sys
import tempfile
import warnings

import torch
from torch import nn

import lightning as L
from lightning.pytorch.plugins.precision import MixedPrecision


class TinyRegressor(L.LightningModule):
    def __init__(self, overflow_steps: set[int]) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
        self.overflow_steps = overflow_steps
        self.backward_passes = 0
        self.net[0].weight.register_hook(self._simulate_fp16_overflow)

    def _simulate_fp16_overflow(self, grad: torch.Tensor):
        self.backward_passes += 1
        return torch.full_like(grad, float("inf")) if self.backward_passes in self.overflow_steps else None

    def training_step(self, batch, batch_index):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--overflow-steps", default="4,11", help="1-based steps whose gradients are made inf")
    parser.add_argument("--output-dir", default=None, help="default: a temporary folder")
    args = parser.parse_args(argv)
    overflow_steps = {int(s) for s in args.overflow_steps.split(",") if s.strip()}

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.steps * 8, 16, generator=generator)
    y = x.sum(dim=1, keepdim=True).sin()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)

    if torch.cuda.is_available():
        precision = {"precision": "16-mixed", "accelerator": "gpu"}
    else:
        precision = {"plugins": [MixedPrecision(precision="16-mixed", device="cpu")], "accelerator": "cpu"}
    trainer = L.Trainer(
        devices=1,
        max_steps=args.steps,
        gradient_clip_val=1.0,  # Lightning unscales before clipping
        default_root_dir=args.output_dir or tempfile.mkdtemp(prefix="lightning_tiny_"),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **precision,
    )
    model = TinyRegressor(overflow_steps)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        trainer.fit(model, loader)

    scaler = trainer.precision_plugin.scaler
    stats = scaler.stats
    summary = {
        "client": "lightning",
        "scaler": type(scaler).__name__,
        "skipped": stats.skipped,
        "steps": stats.steps,
        "scale": stats.scale,
        "global_step": trainer.global_step,
        "ampguard": ampguard.__version__,
    }
    print(
        f"Lightning: {stats.skipped} of {stats.steps} optimizer steps skipped (overflow), loss scale now {stats.scale:g}"
    )
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
