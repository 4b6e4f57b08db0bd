"""A sudden forward overflow in the coqui ``trainer`` costs one batch (issue 35): the tiny XTTS GPT recipe
(coqui_xtts_gpt.py) whose second GPT block's attention gets an input 1000x larger on every 6th batch.

Its logits pass float16's 65504 on those batches only, with no warning before (the headroom watch sees every
module at a few units), so the module is found from the first batch that overflowed: its forward runs again
under the probe at its update (ampguard/fp32_islands/rerun.py) and ``gpt.h.1.attn`` is an island before the
next batch. The references: torch's own GradScaler in the same Trainer loses every loud batch and halves its
scale for each; the probe alone (``AMPGUARD_FORWARD_RERUN=off``) loses two.

The recipe runs through the real coqui Trainer under float16 autocast on the CPU with the Trainer's own
``GradScaler()`` line (see coqui_tiny.py), eager attention (as XTTS's GPT-2 runs it).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from integration_support import require, stock_torch
from scaler_support import one_thread  # noqa: F401  (fixture)

require("trainer")
require("transformers")
import coqui_xtts_gpt  # noqa: E402
from xtts_gpt_underflow import float16_autocast  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]

STEPS = 24
LOUD_EVERY = 6  # batches 6, 12, 18 and 24 (1-based)
LOUDER = 1000.0


@dataclass
class Run:
    lost: list[int]  # the 1-based batches whose loss was inf/NaN
    steps: int
    scale: float
    stats: object  # the scaler's stats (None for torch's own scaler)


def _train(output_path) -> Run:
    with float16_autocast():
        coqui = coqui_xtts_gpt.build_xtts_trainer(output_path, mixed_precision=True, train_samples=8 * STEPS)
        model: coqui_xtts_gpt.TinyXttsGpt = coqui.model
        model.gpt.config._attn_implementation = "eager"
        batches = [0]

        def louder_now_and_then(module, args, kwargs):
            # A loud batch is the batch's: a training call counts, the overflow's forward run again (no autograd)
            # sees the batch as it was, loud.
            if torch.is_grad_enabled():
                batches[0] += 1
            return ((args[0] * LOUDER, *args[1:]), kwargs) if batches[0] % LOUD_EVERY == 0 else None

        model.gpt.h[1].attn.register_forward_pre_hook(louder_now_and_then, with_kwargs=True)
        coqui.fit()
    losses = model.train_losses()
    scaler = coqui.scaler
    return Run(
        [i + 1 for i, loss in enumerate(losses) if not torch.isfinite(torch.tensor(loss))],
        coqui.total_steps_done,
        scaler.get_scale(),
        getattr(scaler, "stats", None),
    )


def test_a_sudden_attention_overflow_in_the_xtts_gpt_recipe_costs_one_batch(tmp_path, reinstall):
    reinstall()
    ours = _train(tmp_path / "ampguard")
    reinstall(AMPGUARD_FORWARD_RERUN="off")
    probe = _train(tmp_path / "probe")
    with stock_torch():
        stock = _train(tmp_path / "stock")
    print(f"\ncoqui xtts gpt, gpt.h.1.attn x{LOUDER:g} every {LOUD_EVERY}: {ours.stats}; probe: {probe.stats}")

    assert ours.steps == probe.steps == stock.steps == STEPS
    assert stock.lost == [6, 12, 18, 24] and stock.scale == 2.0**16 / 2**4  # torch: every loud batch, scale halved
    assert ours.lost == [6]  # the first loud batch only: its forward, run again, named the attention
    assert ours.stats.fp32_islands == ("gpt.h.1.attn",)
    # Lost for the forward overflow only: no backward overflow either (the scale never lowered).
    assert ours.stats.nonfinite_loss == ours.stats.skipped == 1 and ours.stats.min_scale_seen == 1024.0
    assert probe.lost == [6, 12] and probe.stats.fp32_islands == ("gpt.h.1.attn",)  # armed at 6, names at 12
