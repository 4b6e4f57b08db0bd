"""The HF Trainer on a model loaded in float16 with ``fp16=True``: trains like the float32-loaded model.

Plain transformers stops at the first step ("Attempting to unscale FP16
gradients."); under ampguard the optimizer steps float32 master copies
(docs/master-weights.md). A tiny Llama is built from a config, saved, and
loaded back with ``dtype=torch.float16`` (no download).

The CPU shim: accelerate makes no GradScaler and no fp16 autocast on CPU, so
the Trainer's accelerator gets what ``Accelerator.__init__`` does on CUDA
(``hand_cpu_scaler`` from test_accelerate_hf.py: ``native_amp=True`` and a
``torch.amp.GradScaler("cpu")``). Everything else is the real Trainer,
accelerate and torch.
"""

from __future__ import annotations

import pytest
import torch
from integration_support import require, stock_torch
from test_accelerate_hf import _fresh_accelerate_state, hand_cpu_scaler  # noqa: F401

from ampguard import master_weights

pytestmark = pytest.mark.integration

STEPS = 60
VOCAB = 64


@pytest.fixture(scope="module")
def transformers():
    return require("transformers")


def _sequences(count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Learnable data: each sequence counts up by a fixed stride from a random start."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (count, 1), generator=generator)
    rows = (starts + 3 * torch.arange(16)) % VOCAB
    return [{"input_ids": row, "labels": row} for row in rows]


def _saved_tiny_llama(transformers, directory) -> str:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return str(directory)


def fused_adamw_on_cpu() -> None:
    """Skips the calling test where torch's AdamW(fused=True) has no CPU kernel."""
    try:
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], fused=True)
    except (RuntimeError, ValueError):
        pytest.skip("AdamW(fused=True) has no CPU kernel in this torch")


def _load(transformers, path: str, dtype: torch.dtype):
    try:
        return transformers.LlamaForCausalLM.from_pretrained(path, dtype=dtype)
    except TypeError:  # transformers before 4.56 spells it torch_dtype
        return transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=dtype)


def cpu_fp16_trainer(transformers) -> type:
    """The HF Trainer with, on CPU, the scaler accelerate makes on a GPU (``hand_cpu_scaler``)."""

    class CpuFp16Trainer(transformers.Trainer):
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            hand_cpu_scaler(self.accelerator)

    return CpuFp16Trainer


def fp16_arguments(transformers, output_dir, *, steps: int, optim: str, **more: object):
    """The TrainingArguments of these tests: fp16 on CPU, batches of 4, lr 1e-3, no saving, reporting or workers."""
    return transformers.TrainingArguments(
        output_dir=str(output_dir),
        fp16=True,
        use_cpu=True,
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        optim=optim,
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
        **more,
    )


def _train(transformers, path: str, output_dir, dtype: torch.dtype, optim: str) -> tuple[float, float, object]:
    model = _load(transformers, path, dtype)
    assert {p.dtype for p in model.parameters()} == {dtype}
    args = fp16_arguments(transformers, output_dir, steps=STEPS, optim=optim, logging_steps=10)
    held_out = _sequences(16, seed=1)
    trainer = cpu_fp16_trainer(transformers)(
        model=model, args=args, train_dataset=_sequences(STEPS * 4, seed=0), eval_dataset=held_out
    )
    start = trainer.evaluate()["eval_loss"]
    trainer.train()
    return start, trainer.evaluate()["eval_loss"], trainer


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch"])
def test_float16_loaded_llama_trains_like_float32_under_the_hf_trainer(transformers, tmp_path, optim):
    if optim == "adamw_torch_fused":
        fused_adamw_on_cpu()
    path = _saved_tiny_llama(transformers, tmp_path / "llama")
    start32, end32, _ = _train(transformers, path, tmp_path / "fp32", torch.float32, optim)
    start16, end16, trainer = _train(transformers, path, tmp_path / "fp16", torch.float16, optim)
    print(
        f"\nhf-trainer {optim}: float32 model {start32:.3f} -> {end32:.3f}, float16 model {start16:.3f} -> {end16:.3f}"
    )
    assert end32 < start32 - 0.5  # the task is learnt
    assert end16 == pytest.approx(end32, rel=0.05)
    assert all(p.dtype == torch.float16 and torch.isfinite(p).all() for p in trainer.model.parameters())
    copies = master_weights.masters_of(trainer.optimizer.optimizer)  # accelerate's wrapper steps the inner optimizer
    assert len(copies) == sum(1 for p in trainer.model.parameters() if p.requires_grad)
    assert trainer.accelerator.scaler.stats.steps == STEPS


def test_plain_transformers_refuses_the_float16_model(transformers, tmp_path):
    path = _saved_tiny_llama(transformers, tmp_path / "llama")
    with stock_torch(), pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        _train(transformers, path, tmp_path / "stock", torch.float16, "adamw_torch")


def test_without_master_weights_the_float16_model_does_not_get_there(transformers, tmp_path, reinstall):
    reinstall(AMPGUARD_MASTER_WEIGHTS="off")
    path = _saved_tiny_llama(transformers, tmp_path / "llama")
    start, end, trainer = _train(transformers, path, tmp_path / "off", torch.float16, "adamw_torch")
    print(f"\nhf-trainer adamw_torch, AMPGUARD_MASTER_WEIGHTS=off: float16 model {start:.3f} -> {end:.3f}")
    assert not all(torch.isfinite(p).all() for p in trainer.model.parameters()) or end > start - 0.5
