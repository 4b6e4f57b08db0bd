"""A model loaded in float16 whose MLP overflows on some batches, through the HF Trainer's default fused AdamW.

Higgs Audio's case: the model is loaded in float16 (ampguard's master weights
train it), the Trainer steps ``adamw_torch_fused`` (no host read per step), and
one MLP's intermediate ``act(gate(x)) * up(x)`` passes float16's 65504 on the
louder batches (every 10th: its input 4x larger) while the others stay below.
Before, ampguard named the MLP and refused it ("its parameters are float16"),
and every loud batch was lost; plain transformers cannot train the float16 model
at all ("Attempting to unscale FP16 gradients", tests/integration/test_master_weights_hf.py).

The tiny Llama is built from a config, saved and loaded back in float16 (no
download); the Trainer runs on CPU with the scaler accelerate makes on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from integration_support import require
from test_accelerate_hf import _fresh_accelerate_state  # noqa: F401
from test_master_weights_hf import (
    _load,
    _saved_tiny_llama,
    _sequences,
    cpu_fp16_trainer,
    fp16_arguments,
    fused_adamw_on_cpu,
)

pytestmark = pytest.mark.integration

STEPS = 60
LOUD_EVERY = 10
LOUDER = 4.0  # the MLP's input on a loud batch: its intermediate x16, past 65504
WIDEN = 300.0  # gate and up weights x300, down / 300**2: the intermediate peaks at 6,000-10,000 on other batches


@pytest.fixture(scope="module")
def transformers():
    return require("transformers")


def _train(transformers, path: str, output_dir) -> object:
    model = _load(transformers, path, torch.float16)
    layer = model.model.layers[1]
    with torch.no_grad():
        layer.mlp.gate_proj.weight.mul_(WIDEN)
        layer.mlp.up_proj.weight.mul_(WIDEN)
        layer.mlp.down_proj.weight.div_(WIDEN**2)
    calls = [0]

    def louder_now_and_then(module, args, output):
        # A loud batch is the batch's: a training call counts, the overflow's forward run again (no autograd,
        # ampguard/fp32_islands/rerun.py) sees the batch as it was, loud.
        if torch.is_grad_enabled():
            calls[0] += 1
        return output * LOUDER if calls[0] % LOUD_EVERY == 0 else None

    layer.post_attention_layernorm.register_forward_hook(louder_now_and_then)
    args = fp16_arguments(transformers, output_dir, steps=STEPS, optim="adamw_torch_fused", logging_steps=10)
    trainer = cpu_fp16_trainer(transformers)(model=model, args=args, train_dataset=_sequences(STEPS * 4, seed=0))
    trainer.train()
    return trainer


def test_the_float16_mlp_becomes_an_island_and_the_loud_batches_train(transformers, tmp_path, reinstall):
    """The big MLP weights also overflow some scaled gradients (the scale backs off, as torch's would): only the
    non-finite losses are the loud batches'."""
    fused_adamw_on_cpu()
    path = _saved_tiny_llama(transformers, tmp_path / "llama")
    trainer = _train(transformers, path, tmp_path / "ampguard")
    stats = trainer.accelerator.scaler.stats
    reinstall(AMPGUARD_DISABLE="fp32_islands")
    without = _train(transformers, path, tmp_path / "no-islands").accelerator.scaler.stats
    print(f"\nhf-trainer fused, float16 Llama, MLP loud every {LOUD_EVERY}: {stats}; without islands: {without}")
    assert without.nonfinite_loss == STEPS // LOUD_EVERY and without.fp32_islands == ()
    assert stats.fp32_islands == ("model.layers.1.mlp",)
    assert stats.nonfinite_loss <= 1  # of 6 loud batches: the first one's forward, run again, names the MLP
    mlp = trainer.model.model.layers[1].mlp
    assert {p.dtype for p in mlp.parameters()} == {torch.float16}  # the island computes in float32, keeps float16
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
