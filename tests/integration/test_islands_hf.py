"""fp32 islands in a real model and trainer: a tiny GPT-2 (eager attention) through the HF Trainer with fp16.

The second layer's query/key weights are scaled up (as weights pretrained in
bf16 can be), so its attention logits pass float16's 65504 on every batch and
the loss is NaN; in float32 they are harmless. The Trainer runs on CPU with the
scaler accelerate would make on a GPU (see test_accelerate_hf.py).
"""

from __future__ import annotations

import logging

import pytest
import torch
from integration_support import require, stock_torch, torch_grad_scaler

require("accelerate")
transformers = require("transformers")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from test_accelerate_hf import hand_cpu_scaler  # noqa: E402

pytestmark = pytest.mark.integration

STEPS = 8
FACTOR = 3000.0  # on layer 1's query/key weights: logits ~1e5


@pytest.fixture(autouse=True)
def _fresh_state():
    import ampguard

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    ampguard.uninstall()  # islands are process state: start without any
    ampguard.install()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _trainer(output_dir, scaler_class=None, optim="adamw_torch"):
    class CpuFp16Trainer(transformers.Trainer):
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            hand_cpu_scaler(self.accelerator, scaler_class)

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0
    )
    config._attn_implementation = "eager"
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        model.transformer.h[1].attn.c_attn.weight[:, : 2 * config.n_embd].mul_(FACTOR)
    tokens = torch.randint(0, 64, (STEPS * 2, 16), generator=torch.Generator().manual_seed(0))
    args = transformers.TrainingArguments(
        output_dir=str(output_dir),
        fp16=True,
        use_cpu=True,
        max_steps=STEPS,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        optim=optim,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    return CpuFp16Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in tokens])


# adamw_torch_fused (the Trainer's default from torch 2.8 on) steps without a host read: ampguard learns of
# the overflow when its Trainer callback reads the scaler's stats at the Trainer's logging step (every step here).
@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_tiny_gpt2_overflowing_layer_is_named_and_healed_through_the_hf_trainer(optim, tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("ampguard"), "propagate", True)
    caplog.set_level(logging.INFO, logger="ampguard")
    hf = _trainer(tmp_path / "ampguard", optim=optim)
    assert getattr(hf.create_optimizer(), "_step_supports_amp_scaling", False) == (optim == "adamw_torch_fused")
    hf.train()
    stats = hf.accelerator.scaler.stats
    assert stats.fp32_islands == ("transformer.h.1.attn",)
    assert stats.skipped == stats.nonfinite_loss == 2  # the step that armed the probe, the one that named it
    assert stats.scale >= 1024.0
    made = {
        r.getMessage() for r in caplog.records if r.getMessage().startswith("fp32 island:")
    }  # (caplog may see a record twice)
    assert len(made) == 1 and made.pop().startswith("fp32 island: transformer.h.1.attn (GPT2Attention)")
    assert all(torch.isfinite(p).all() for p in hf.model.parameters())

    with stock_torch():  # torch's scaler with the same settings: every step overflows, none trains
        stock = _trainer(
            tmp_path / "stock", scaler_class=torch_grad_scaler(init_scale=1024.0, growth_interval=100), optim=optim
        )
        stock.train()
        assert stock.accelerator.scaler.get_scale() == 1024.0 / 2**STEPS  # all 8 steps skipped
