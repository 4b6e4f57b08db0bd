"""The HF Trainer (transformers on accelerate) with ampguard, on a tiny GPT-2 built from a config.

    pip install transformers accelerate   # or: pip install -e '.[integration]'
    python examples/hf_trainer_tiny.py

No download: the model is built from a ``GPT2Config`` and trained on random
tokens. The only ampguard line is the first import.

On a GPU, ``TrainingArguments(fp16=True)`` makes accelerate build
``torch.amp.GradScaler("cuda")`` in ``Accelerator.__init__``: with ampguard
imported that is a SafeGradScaler (init_scale 1024, growth every 100 steps),
and nothing else changes. accelerate makes no scaler on a CPU, so there this
script does what accelerate does on CUDA (``native_amp`` on, which autocasts
``forward`` to fp16, and a GradScaler built with the ``GradScalerKwargs``) in
``create_accelerator_and_postprocess``. A CPU run cannot be relied on to overflow
fp16, so ``--overflow-steps`` makes one layer's gradient inf on the given
steps: what an fp16 overflow looks like to the scaler on a GPU.

The last line printed is a JSON summary with the skipped-step count.
"""

import ampguard  # noqa: I001  (first: patches torch's GradScaler before accelerate builds one)

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers


class Fp16Trainer(transformers.Trainer):
    """The HF Trainer, plus a CPU GradScaler where accelerate makes none."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        accelerator = self.accelerator
        if accelerator.mixed_precision == "fp16" and accelerator.scaler is None and accelerator.device.type == "cpu":
            kwargs = accelerator.scaler_handler.to_kwargs() if accelerator.scaler_handler is not None else {}
            accelerator.native_amp = True  # autocast forward to fp16; unscale before clipping
            accelerator.scaler = torch.amp.GradScaler("cpu", **kwargs)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps")
    parser.add_argument("--overflow-steps", default="3,8", help="1-based steps whose gradients are made inf")
    parser.add_argument(
        "--optim",
        default="adamw_torch",
        help="TrainingArguments.optim. The Trainer's own default from torch 2.8, adamw_torch_fused, is stepped by "
        "every GradScaler (torch's too) even on a skipped step, so accelerate cannot see the skip and the LR "
        "scheduler steps anyway; ampguard still counts it.",
    )
    parser.add_argument("--output-dir", default=None, help="default: a temporary folder")
    args = parser.parse_args(argv)
    overflow_steps = {int(s) for s in args.overflow_steps.split(",") if s.strip()}

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    tokens = torch.randint(0, config.vocab_size, (args.steps * 4, 32), generator=torch.Generator().manual_seed(0))
    dataset = [{"input_ids": row, "labels": row} for row in tokens]

    training_args = transformers.TrainingArguments(
        output_dir=args.output_dir or tempfile.mkdtemp(prefix="hf_trainer_tiny_"),
        fp16=True,
        use_cpu=not torch.cuda.is_available(),
        max_steps=args.steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        max_grad_norm=1.0,
        optim=args.optim,
        logging_steps=4,
        save_strategy="steps",
        save_steps=args.steps // 2,  # scaler.pt is saved with the checkpoint
        report_to="none",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    hf = Fp16Trainer(model=model, args=training_args, train_dataset=dataset)

    backward_passes = 0

    def simulate_fp16_overflow(grad: torch.Tensor):
        nonlocal backward_passes
        backward_passes += 1
        return torch.full_like(grad, float("inf")) if backward_passes in overflow_steps else None

    model.transformer.h[0].mlp.c_fc.weight.register_hook(simulate_fp16_overflow)
    hf.train()

    scaler = hf.accelerator.scaler
    stats = scaler.stats
    summary = {
        "client": "hf-trainer",
        "scaler": type(scaler).__name__,
        "skipped": stats.skipped,
        "steps": stats.steps,
        "scale": stats.scale,
        "global_step": hf.state.global_step,
        "lr_scheduler_steps": hf.lr_scheduler.last_epoch,
        "ampguard": ampguard.__version__,
    }
    print(
        f"HF Trainer: {stats.skipped} of {stats.steps} optimizer steps skipped (overflow), loss scale now {stats.scale:g}"
    )
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
