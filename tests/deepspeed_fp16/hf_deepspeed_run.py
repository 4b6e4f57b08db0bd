"""The HF Trainer with a DeepSpeed config (fp16, ZeRO 2) on the CPU, one rank: plain DeepSpeed, then under ampguard.

``python hf_deepspeed_run.py STEPS`` trains a small model whose block overflows float16 on every call, twice in one
process: with ampguard uninstalled (DeepSpeed's own scaler), then installed. Prints one JSON line per run: the
exception that ended it (or null), the engine's skipped steps, ampguard's counts and the Trainer's
``log_history``. As in deepspeed_run.py, DeepSpeed's CPU accelerator is told it runs float16 (this script only).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", HF_HUB_OFFLINE="1")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29562")

import torch

import ampguard
import ampguard.deepspeed_fp16.tracking as tracking

# isort: split
# deepspeed (through accelerate) and transformers are imported after ampguard, as a script that imports it first does
from deepspeed.accelerator import get_accelerator
from transformers import Trainer, TrainingArguments

get_accelerator().is_fp16_supported = lambda: True  # the CPU runs DeepSpeed's float16 paths (this test's only)
for _name in ("DeepSpeed", "deepspeed", "transformers"):
    logging.getLogger(_name).setLevel(logging.ERROR)


class Net(torch.nn.Module):
    """Linear, a block whose output times 1e5 overflows float16, Linear; returns the loss as the Trainer wants."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(8, 16)
        self.loud = torch.nn.Linear(16, 16)
        self.last = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        y = self.loud(torch.nn.functional.gelu(self.first(x))) * 1e5
        return {"loss": torch.nn.functional.mse_loss(self.last(y).float(), labels.float())}


class Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        return {"x": torch.randn(8, generator=generator), "labels": torch.randn(1, generator=generator)}


def train(steps: int, guarded: bool) -> dict[str, Any]:
    ampguard.uninstall()
    if guarded:
        ampguard.install()
    deepspeed_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "fp16": {"enabled": "auto"},
        "zero_optimization": {"stage": 2},
    }
    arguments = TrainingArguments(
        output_dir=os.path.join(sys.argv[2], "guarded" if guarded else "plain"),
        per_device_train_batch_size=8,
        max_steps=steps,
        fp16=True,
        deepspeed=deepspeed_config,
        logging_steps=8,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = Trainer(model=Net(), args=arguments, train_dataset=Data())
    died = None
    try:
        trainer.train()
    except Exception as error:
        died = f"{type(error).__name__}: {error}"
    engine = trainer.model_wrapped
    counts = tracking.of(engine.optimizer)
    return {
        "died": died,
        "engine_skipped": engine.skipped_steps,
        "ampguard": counts.stats.as_dict() if counts is not None else None,
        "log_history": trainer.state.log_history,
    }


def main() -> None:
    steps = int(sys.argv[1])
    for guarded in (False, True):
        print(json.dumps(train(steps, guarded)), flush=True)


if __name__ == "__main__":
    main()
