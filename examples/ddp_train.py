"""A plain DistributedDataParallel fp16 training script for torchrun. It knows nothing of ampguard.

Run it with ampguard, unedited::

    torchrun --nproc-per-node 2 -m ampguard run examples/ddp_train.py

or without, for comparison::

    torchrun --nproc-per-node 2 examples/ddp_train.py

On GPUs it uses NCCL, one GPU per process and ``torch.amp.GradScaler("cuda")``;
without GPUs it uses gloo on CPU with CPU float16 autocast (about 20 s on a
laptop). Each rank trains a small MLP on its own synthetic batches. At step
``--overflow-step`` the last rank's loss is multiplied by 1e8, so its float16
backward pass overflows while every other rank's stays finite: DDP's gradient
all-reduce spreads the inf, every rank skips that step, and the parameters stay
identical on every rank.

At the end rank 0 prints one line with what the script itself observed, e.g.::

    ddp_train: world=2 steps=60 skipped=1 ampguard_skipped=1 scale=512 params_identical=True seconds=3.1

``skipped`` counts the steps whose ``scaler.update()`` lowered the scale, the
way trainers detect skips; ``ampguard_skipped`` is ``scaler.stats.skipped``
(``-`` without ampguard).
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (default 60)")
    parser.add_argument(
        "--overflow-step", type=int, default=10, help="step at which the last rank overflows (-1: never)"
    )
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch", type=int, default=32)
    return parser.parse_args()


def init_distributed() -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes (or a 1-process group when run with plain python)."""
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return rank, world, torch.device("cuda", local_rank)
    return rank, world, torch.device("cpu")


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8))


def params_identical_across_ranks(model: nn.Module, world: int, keep: list[torch.Tensor]) -> bool:
    """All-gather a checksum of this rank's parameters and compare them (the tensors exchanged go into ``keep``)."""
    local = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum().reshape(1)
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    keep += [local, *gathered]
    return all(torch.equal(gathered[0], other) for other in gathered[1:])


def main() -> None:
    args = parse_args()
    rank, world, device = init_distributed()
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts them)
    model = DistributedDataParallel(
        make_model().to(device), device_ids=[device.index] if device.type == "cuda" else None
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scaler = torch.amp.GradScaler(device.type)
    data = torch.Generator(device="cpu").manual_seed(1000 + rank)  # each rank its own shard of data
    target_map = torch.randn(64, 8, generator=torch.Generator().manual_seed(7))

    skipped = 0
    started = time.perf_counter()
    for step in range(args.steps):
        inputs = torch.randn(args.batch, 64, generator=data)
        targets = inputs @ target_map
        inputs, targets = inputs.to(device), targets.to(device)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.float16):
            loss = F.mse_loss(model(inputs).float(), targets)
        if step == args.overflow_step and rank == world - 1:
            loss = loss * 1e8  # finite in float32; its float16 backward overflows
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scale_before = scaler.get_scale()
        scaler.update()
        if scaler.get_scale() < scale_before:
            skipped += 1
        if rank == 0 and (step + 1) % 20 == 0:
            print(
                f"ddp_train: step {step + 1}/{args.steps} loss {loss.item():.4f} scale {scaler.get_scale():g}",
                flush=True,
            )

    exchanged: list[torch.Tensor] = []
    identical = params_identical_across_ranks(model, world, exchanged)
    stats = getattr(scaler, "stats", None)  # ampguard's SafeGradScaler counts skips exactly
    if rank == 0:
        print(
            f"ddp_train: world={world} steps={args.steps} skipped={skipped} "
            f"ampguard_skipped={stats.skipped if stats is not None else '-'} scale={scaler.get_scale():g} "
            f"params_identical={identical} seconds={time.perf_counter() - started:.1f}",
            flush=True,
        )
    # On torch < 2.8 a process group is destroyed holding the GIL (pytorch/pytorch#154976), and a gloo
    # thread that still has to free the Python object of a tensor it exchanged waits for the GIL: both hang
    # at exit (a few runs in 30 on torch 2.3). So the tensors exchanged here outlive the group, and DDP,
    # whose C++ Reducer also holds the group, goes first.
    del model
    dist.destroy_process_group()
    del exchanged


if __name__ == "__main__":
    main()
