"""A sudden forward overflow through the HF Trainer costs one batch (issue 35): a tiny Llama whose MLP's input
is 1000x larger on every 7th batch, loaded in float16 (master weights) or in float32, fused AdamW (the
Trainer's default) or ``adamw_torch``.

Nothing warns before the first loud batch (the headroom watch sees the MLP at a few units on the others), so
the module is found from the batch that overflowed: its forward runs again under the probe at its update
(ampguard/fp32_islands/rerun.py) and ``model.layers.1.mlp`` is an island before the next batch. The
references: plain torch's scaler loses every loud batch (float32-loaded; plain transformers cannot train the
float16-loaded model at all, tests/integration/test_master_weights_hf.py), and the probe alone
(``AMPGUARD_FORWARD_RERUN=off``) loses two, the one that arms it and the one at which it names the module.

The tiny Llama is built from a config, saved and loaded back (no download); the Trainer runs on CPU with the
scaler accelerate makes on a GPU (``hand_cpu_scaler``).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from integration_support import require, stock_torch
from scaler_support import one_thread  # noqa: F401  (fixture)
from test_accelerate_hf import _fresh_accelerate_state  # noqa: F401
from test_master_weights_hf import (
    _load,
    _saved_tiny_llama,
    _sequences,
    cpu_fp16_trainer,
    fp16_arguments,
    fused_adamw_on_cpu,
)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]

STEPS = 21
LOUD_EVERY = 7  # batches 7, 14 and 21 (1-based)
LOUDER = 1000.0  # the MLP's input: its intermediate act(gate(x)) * up(x) passes float16's 65504


@pytest.fixture(scope="module")
def transformers():
    return require("transformers")


@dataclass
class Run:
    lost: list[int]  # the 1-based batches whose loss was inf/NaN
    scale: float
    stats: object  # the scaler's stats (None for torch's own scaler)
    model: torch.nn.Module


def _train(transformers, path: str, output_dir, dtype: torch.dtype, optim: str) -> Run:
    model = _load(transformers, path, dtype)
    batches, lost = [0], []

    def louder_now_and_then(module, args):
        # A loud batch is the batch's: a training call counts, the overflow's forward run again (no autograd)
        # sees the batch as it was, loud.
        if torch.is_grad_enabled():
            batches[0] += 1
        return (args[0] * LOUDER, *args[1:]) if batches[0] % LOUD_EVERY == 0 else None

    def note_loss(module, args, output):
        if torch.is_grad_enabled() and not torch.isfinite(output.loss):
            lost.append(batches[0])

    model.model.layers[1].mlp.register_forward_pre_hook(louder_now_and_then)
    model.register_forward_hook(note_loss)
    args = fp16_arguments(transformers, output_dir, steps=STEPS, optim=optim)
    trainer = cpu_fp16_trainer(transformers)(model=model, args=args, train_dataset=_sequences(STEPS * 4, seed=0))
    trainer.train()
    scaler = trainer.accelerator.scaler
    return Run(lost, scaler.get_scale(), getattr(scaler, "stats", None), trainer.model)


@pytest.mark.parametrize(
    ("dtype", "optim"),
    [
        (torch.float16, "adamw_torch_fused"),
        (torch.float16, "adamw_torch"),
        (torch.float32, "adamw_torch_fused"),
        (torch.float32, "adamw_torch"),
    ],
    ids=["float16-fused", "float16-adamw", "float32-fused", "float32-adamw"],
)
def test_a_sudden_mlp_overflow_costs_one_batch(transformers, tmp_path, reinstall, dtype, optim):
    if optim == "adamw_torch_fused":
        fused_adamw_on_cpu()
    path = _saved_tiny_llama(transformers, tmp_path / "llama")
    reinstall()
    ours = _train(transformers, path, tmp_path / "ampguard", dtype, optim)
    reinstall(AMPGUARD_FORWARD_RERUN="off")
    probe = _train(transformers, path, tmp_path / "probe", dtype, optim)
    print(
        f"\nhf-trainer {optim}, {dtype} Llama, MLP x{LOUDER:g} every {LOUD_EVERY}: {ours.stats}; probe: {probe.stats}"
    )

    assert ours.lost == [7]  # the first loud batch only: its forward, run again, named the MLP
    assert ours.stats.fp32_islands == ("model.layers.1.mlp",)
    # Lost for the forward overflow only: no backward overflow either (the scale never lowered).
    assert ours.stats.nonfinite_loss == ours.stats.skipped == 1 and ours.stats.min_scale_seen == 1024.0
    assert probe.lost == [7, 14] and probe.stats.fp32_islands == ("model.layers.1.mlp",)  # armed at 7, names at 14
    assert probe.stats.nonfinite_loss == 2
    mlp = ours.model.model.layers[1].mlp
    assert {p.dtype for p in mlp.parameters()} == {dtype}  # the island computes in float32, its weights kept
    assert all(torch.isfinite(p).all() for p in ours.model.parameters())
    if dtype == torch.float32:
        with stock_torch():  # torch's own scaler: every loud batch lost, the scale halved for each
            stock = _train(transformers, path, tmp_path / "stock", dtype, optim)
        assert stock.lost == [7, 14, 21] and stock.scale == 2.0**16 / 2**3
