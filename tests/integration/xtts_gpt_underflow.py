"""The tiny XTTS GPT recipe (coqui_xtts_gpt.py) in the coqui Trainer: float32, or float16 autocast under
ampguard with ``AMPGUARD_UNDERFLOW=off|report|adapt``, and what the underflow patch measured on the way.

Used by tests/integration/test_underflow_coqui_gpt.py, and run as a script for docs/underflow.md's numbers::

    python tests/integration/xtts_gpt_underflow.py [--epochs 1] [--every 100]
    python tests/integration/xtts_gpt_underflow.py --pretrain-epochs 8 --lr 1e-4  # a fine-tune

prints one JSON line per run (float32, off, report, adapt) and a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # the helper modules next to this file import by name
    sys.path.insert(0, str(Path(__file__).parent))

import coqui_xtts_gpt
import torch
from coqui_xtts_gpt import Trainer
from integration_support import note_new_sample, samples_text

import ampguard

MODES = ("float32", "off", "report", "adapt")


@dataclass
class Run:
    """One run's outcome: ``samples`` holds, per sampled step, the shares measured and the scale it ran at."""

    mode: str
    steps: int
    eval_loss: float
    train_losses: list[float]
    stats: dict[str, Any] = field(default_factory=dict)  # the scaler's, at the end (float16 runs)
    samples: list[dict[str, Any]] = field(default_factory=list)
    model_state: dict[str, Any] = field(default_factory=dict, repr=False)  # the weights at the end

    @property
    def tail_loss(self) -> float:
        """The mean train loss of the last 50 steps."""
        return statistics.fmean(self.train_losses[-50:])

    def row(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "steps": self.steps,
            "eval_loss": round(self.eval_loss, 5),
            "tail_loss": round(self.tail_loss, 5),
            **{key: self.stats.get(key) for key in ("skipped", "scale", "underflow_samples", "underflow_growths")},
            "modules": self.stats.get("underflow_modules"),
            "samples": self.samples,
        }


@contextlib.contextmanager
def float16_autocast() -> Iterator[None]:
    """The coqui Trainer autocasts to float16 on the CPU inside the block (on CPU it would pick bfloat16)."""
    previous = Trainer._get_autocast_args
    Trainer._get_autocast_args = coqui_xtts_gpt.float16_autocast_args  # type: ignore[method-assign]
    try:
        yield
    finally:
        Trainer._get_autocast_args = previous  # type: ignore[method-assign]


def train(
    output_path: Path | str, *, float16: bool, epochs: int, start: dict[str, Any] | None = None, **config: Any
) -> Run:
    """Trains the recipe for ``epochs`` (``train_samples / 8`` optimizer steps each, 320 by default) under the
    ampguard installed now; from the weights ``start`` (a state dict) when given."""
    with float16_autocast() if float16 else contextlib.nullcontext():
        coqui = coqui_xtts_gpt.build_xtts_trainer(output_path, mixed_precision=float16, epochs=epochs, **config)
        if start is not None:
            coqui.model.load_state_dict(start)  # in place: the optimizer holds these parameters
        samples: list[dict[str, Any]] = []

        def note_sample(trainer: Trainer) -> None:
            if trainer.scaler is not None:
                note_new_sample(trainer.scaler.stats.as_dict(), samples)

        coqui.callbacks.parse_callbacks_dict({"on_train_step_end": note_sample})
        coqui.fit()
    model: coqui_xtts_gpt.TinyXttsGpt = coqui.model
    return Run(
        mode="float16" if float16 else "float32",
        steps=coqui.total_steps_done,
        eval_loss=model.eval_loss(),
        train_losses=model.train_losses(),
        stats=coqui.scaler.stats.as_dict() if coqui.scaler is not None else {},
        samples=samples,
        model_state={key: value.clone() for key, value in model.state_dict().items()},
    )


def run_mode(output_path: Path | str, mode: str, *, epochs: int, every: int, **config: Any) -> Run:
    """``mode``: "float32", or an ``AMPGUARD_UNDERFLOW`` value for a float16 run (ampguard installed again)."""
    if mode == "float32":
        return train(output_path, float16=False, epochs=epochs, **config)
    os.environ.update(AMPGUARD_UNDERFLOW=mode, AMPGUARD_UNDERFLOW_EVERY=str(every))
    ampguard.uninstall()
    ampguard.install()
    run = train(output_path, float16=True, epochs=epochs, **config)
    run.mode = mode
    return run


def _table(runs: list[Run], reference: Run) -> str:
    lines = [
        "| run | samples | underflow at the sampled steps (scale) | growths | final scale | skipped "
        "| eval loss (float32 + %) | last-50 train loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        change = (run.eval_loss / reference.eval_loss - 1) * 100
        lines.append(
            f"| {run.mode} | {run.stats.get('underflow_samples', '-')} | {samples_text(run.samples)} "
            f"| {run.stats.get('underflow_growths', '-')} | {run.stats.get('scale', '-')} "
            f"| {run.stats.get('skipped', '-')} | {run.eval_loss:.4f} ({change:+.2f}%) | {run.tail_loss:.4f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1, help="of 320 steps")
    parser.add_argument("--every", type=int, default=100, help="AMPGUARD_UNDERFLOW_EVERY")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument(
        "--pretrain-epochs",
        type=int,
        default=0,
        help="fine-tune: start every run from the weights of this many epochs of float32 training (data seed 0), "
        "and train on new samples (seed 2)",
    )
    parser.add_argument("--lr", type=float, default=coqui_xtts_gpt.LR)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    config: dict[str, Any] = {"lr": args.lr}
    if args.pretrain_epochs:
        with tempfile.TemporaryDirectory() as output:
            pretrained = train(output, float16=False, epochs=args.pretrain_epochs)
        print(json.dumps({"pretrained": pretrained.steps, "eval_loss": pretrained.eval_loss}), flush=True)
        config |= {"start": pretrained.model_state, "data_seed": 2}
    runs = []
    for mode in args.modes:
        with tempfile.TemporaryDirectory() as output:
            runs.append(run_mode(output, mode, epochs=args.epochs, every=args.every, **config))
        print(json.dumps(runs[-1].row()), flush=True)
    print(_table(runs, runs[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
