"""A fine-tuning loop in the shape of XTTS under the coqui trainer, small enough for a CPU.

It is written the way such scripts are, and knows nothing of ampguard:

* fp16 autocast through the legacy spelling (``torch.cpu.amp.autocast`` here;
  ``torch.cuda.amp.autocast`` on a GPU);
* the GradScaler class bound at import time the way the coqui trainer does
  (``GradScaler = functools.partial(torch.GradScaler, device=...)``), the
  instance made when the trainer is built;
* gradient accumulation, ``scaler.unscale_`` then ``clip_grad_norm_``;
* a second optimizer (a speaker-adapter that this recipe keeps frozen), as
  multi-optimizer coqui models have.

Four scenarios, each a short run:

``calibration``  the loss scale's first steps: how many optimizer steps the
                 scaler burns before it finds a scale that does not overflow;
``storm``        a burst of corrupt batches (inf in their features, as a broken
                 audio file gives: the loss is NaN in any precision), then
                 normal data again: does training recover?
``no_grad``      the frozen second optimizer gets no gradient.
``hot_block``    one feed-forward block's weights are far larger than float16
                 activations allow (as weights trained in bf16 can be): every
                 batch overflows float16 in that block, none does in float32.

Run it as is (plain torch), or with ampguard and no edit::

    python examples/xtts_style_finetune.py
    python -m ampguard run examples/xtts_style_finetune.py

``examples/demo.py`` runs both and prints them side by side. The last line of
output is a JSON summary.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
import warnings

import torch
from torch import nn

# As coqui's trainer/trainer.py does at import time (device "cuda" there).
GradScaler = functools.partial(torch.GradScaler, device="cpu")

VOCAB, WIDTH, FRAMES, BATCH = 64, 32, 16, 4


class TinyGPT(nn.Module):
    """Text tokens in, next "audio code" out: XTTS's GPT in miniature."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(
            *[nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=0.0, batch_first=True) for _ in range(1)]
        )
        self.head = nn.Linear(WIDTH, VOCAB)
        self.speaker_adapter = nn.Linear(WIDTH, WIDTH)  # frozen by this recipe: no gradient reaches it

    def forward(self, tokens: torch.Tensor, loudness: torch.Tensor | float = 1.0) -> torch.Tensor:
        hidden = self.embed(tokens) * loudness
        return self.head(self.blocks(hidden))


def batches(seed: int):
    generator = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.randint(0, VOCAB, (BATCH, FRAMES + 1), generator=generator)
        tokens[:, 1::2] = (tokens[:, 0::2][:, : tokens[:, 1::2].shape[1]] * 7 + 3) % VOCAB  # learnable structure
        yield tokens[:, :-1], tokens[:, 1:]


class Trainer:
    """The parts of a coqui-style trainer that touch mixed precision."""

    def __init__(self, model: nn.Module, grad_clip: float, accumulation: int, second_optimizer: bool) -> None:
        self.model = model
        trained = [p for n, p in model.named_parameters() if not n.startswith("speaker_adapter")]
        self.optimizers = [torch.optim.AdamW(trained, lr=2e-3)]
        if second_optimizer:
            self.optimizers.append(torch.optim.AdamW(model.speaker_adapter.parameters(), lr=1e-4))
        self.scaler = GradScaler()
        self.grad_clip = grad_clip
        self.accumulation = accumulation
        self.skipped = 0

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], loudness: torch.Tensor) -> float:
        total = 0.0
        for tokens, targets in micro_batches:
            with torch.cpu.amp.autocast(dtype=torch.float16):
                logits = self.model(tokens, loudness)
                # Summed over frames, as TTS losses are: large values, large gradients.
                loss = nn.functional.cross_entropy(
                    logits.float().reshape(-1, VOCAB), targets.reshape(-1), reduction="sum"
                )
            self.scaler.scale(loss / self.accumulation).backward()
            total += loss.item() / self.accumulation
        scale_before = self.scaler.get_scale()  # coqui's skip detection: scale before vs after
        for optimizer in self.optimizers:
            self.scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], self.grad_clip)
            self.scaler.step(optimizer)
        self.scaler.update()
        if self.scaler.get_scale() < scale_before:
            self.skipped += 1
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        return total


def run(scenario: str, steps: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = TinyGPT()
    if scenario == "hot_block":
        with torch.no_grad():
            model.blocks[0].linear1.weight.mul_(1e5)
    trainer = Trainer(model, grad_clip=1.0, accumulation=2, second_optimizer=scenario == "no_grad")
    data = batches(seed=1)
    storm = range(steps // 4, steps // 4 + 24) if scenario == "storm" else range(0)
    initial_scale = trainer.scaler.get_scale()
    losses: list[float] = []
    started = time.perf_counter()
    outcome = "finished"
    try:
        for step in range(steps):
            # A corrupt batch (its gain is inf): no precision gives a finite loss.
            loudness = torch.tensor(math.inf if step in storm else 1.0)
            loss = trainer.train_step([next(data) for _ in range(trainer.accumulation)], loudness)
            if math.isfinite(loss):
                losses.append(loss)
    except Exception as error:  # the demo reports a crash instead of dying
        outcome = f"crashed: {type(error).__name__}: {error}"
    tail = losses[-10:] or [float("nan")]
    stats = getattr(trainer.scaler, "stats", None)  # a SafeGradScaler's counters, when ampguard is installed
    return {
        "scenario": scenario,
        "outcome": outcome,
        "steps_run": step + 1 if outcome == "finished" else step,
        # coqui's own count (scale dropped) misses skips at a floor; SafeGradScaler counts exactly.
        "skipped_steps": stats.skipped if stats is not None else trainer.skipped,
        "corrupt_batches": len(storm),
        "initial_scale": initial_scale,
        "first_loss": round(losses[0], 3) if losses else None,
        "final_loss": round(sum(tail) / len(tail), 3),
        "final_scale": trainer.scaler.get_scale(),
        "seconds": round(time.perf_counter() - started, 1),
        # The modules ampguard made fp32 islands, in the order it made them (none without ampguard).
        "fp32_islands": list(getattr(stats, "fp32_islands", ())),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=["calibration", "storm", "no_grad", "hot_block", "all"], default="all")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per scenario")
    args = parser.parse_args()
    torch.set_num_threads(1)
    scenarios = ["calibration", "storm", "no_grad", "hot_block"] if args.scenario == "all" else [args.scenario]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = []
        for name in scenarios:
            # A header on stderr, where ampguard's stats lines go: they belong to the scenario named last.
            print(f"--- scenario {name} ({args.steps} steps) ---", file=sys.stderr, flush=True)
            results.append(run(name, args.steps))
    deprecations = sorted(
        {str(w.message).split("(")[0].strip("`") for w in caught if issubclass(w.category, FutureWarning)}
    )
    for result in results:
        print(
            f"{result['scenario']:>12}: {result['outcome']}; skipped {result['skipped_steps']} of {result['steps_run']} steps; "
            f"loss {result['first_loss']} -> {result['final_loss']}; final scale {result['final_scale']:g}"
        )
    print(f"FutureWarnings: {len(deprecations)}" + "".join(f"\n  {d}" for d in deprecations))
    print(json.dumps({"results": results, "future_warnings": deprecations, "ampguard": "ampguard" in sys.modules}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
