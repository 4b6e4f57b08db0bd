"""What a sampled step costs against a healthy one, by depth and calling convention (issue 32; docs/underflow.md).

The model of tests/underflow/test_underflow_walk.py (pre-norm blocks of width 16: all per-op overhead, the sampler's worst
case) at 24, 96 and 384 blocks, its modules called positionally and by keyword (HF's convention). A healthy step:
a float16-autocast forward and backward and an SGD step (momentum, torch's default foreach implementation); a
sampled step: the same with the sampler armed, the parameters' gradients counted (as its scaler's ``unscale_()``
has it do), finished and read.
Steps alternate, one thread; the medians and their ratio::

    python tests/underflow/underflow_sample_cost.py [--depths 24 96 384] [--repeats 15] [--width 16] [--tokens 12]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "support")]

import test_underflow_walk
import torch
from test_underflow_walk import inputs, net

from ampguard.underflow.counts import read
from ampguard.underflow.measure import Sampler


def step(model: torch.nn.Module, x: torch.Tensor, sampler: Sampler | None, optimizer: torch.optim.Optimizer) -> float:
    start = time.perf_counter()
    if sampler is not None:
        sampler.arm()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    if sampler is not None:
        sampler.count_parameters(optimizer)  # (what its scaler's unscale_() has it do)
    optimizer.step()
    optimizer.zero_grad()
    if sampler is not None:
        read(sampler.finish(), step=2, scale=1.0)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[24, 96, 384])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--width", type=int, default=test_underflow_walk.WIDTH)
    parser.add_argument("--tokens", type=int, default=12, help="per step (test_underflow_walk's inputs: 12)")
    args = parser.parse_args(argv)
    test_underflow_walk.WIDTH = args.width
    torch.set_num_threads(1)
    print(f"width {args.width}, {args.tokens} tokens per step, torch {torch.__version__}, one thread")
    print("| blocks | calls | healthy step (ms) | sampled step (ms) | ratio |")
    print("|---|---|---|---|---|")
    for depth in args.depths:
        for keyword in (False, True):
            model, sampler = net(depth, keyword), Sampler()
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-9, momentum=0.9)
            x = inputs() if args.tokens == 12 else torch.randn(1, args.tokens, args.width)
            healthy, sampled = [], []
            for index in range(args.repeats + 2):
                times = (step(model, x, None, optimizer), step(model, x, sampler, optimizer))
                if index >= 2:  # (warm-up)
                    healthy.append(times[0])
                    sampled.append(times[1])
            h, s = statistics.median(healthy) * 1e3, statistics.median(sampled) * 1e3
            convention = "keyword" if keyword else "positional"
            print(f"| {depth} | {convention} | {h:.1f} | {s:.1f} | {s / h:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
