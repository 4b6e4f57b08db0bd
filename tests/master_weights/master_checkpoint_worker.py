"""The training of tests/master_weights/test_master_checkpoints.py, imported by the test or run as a script.

``python master_checkpoint_worker.py MODE CHECKPOINT OUT`` (a new process: ampguard imported first, as a user's
script does, except for ``plain_load``, which is plain torch) or :func:`main` in the test's own process: ``full``
trains 80 steps, ``first`` 40 and saves the checkpoint with ``torch.save``, ``resume`` loads it with
``weights_only=True`` and trains the 40 more, ``plain_load`` loads it; each but ``first`` saves the parameters and
the optimizer's state to OUT. The loop has the usual recipe (scale, unscale_, clip, step, update) and an injected
overflow on each side of the checkpoint.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and sys.argv[1] != "plain_load":
    import ampguard  # noqa: F401

import torch
import torch.nn.functional as F

FAULTS = {13, 57}


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).half()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=4096.0, growth_interval=10)
    return model, optimizer, scaler


def train(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, start: int, stop: int
) -> None:
    for step in range(start, stop):
        data = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=data), torch.randn(8, 4, generator=data)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        scaler.scale(F.mse_loss(out.float(), y)).backward()
        if step in FAULTS:
            model[0].weight.grad[0, 0] = float("inf")
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()


def main(mode: str, checkpoint_path: str, out: str) -> None:
    model, optimizer, scaler = build()
    if mode == "full":
        train(model, optimizer, scaler, 0, 80)
    elif mode == "first":
        train(model, optimizer, scaler, 0, 40)
        saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()}
        torch.save(saved, checkpoint_path)
        return
    else:
        checkpoint = torch.load(checkpoint_path, weights_only=True)
        # the optimizer first, the model after it: the order must not matter
        optimizer.load_state_dict(checkpoint["optimizer"])
        model.load_state_dict(checkpoint["model"])
        scaler.load_state_dict(checkpoint["scaler"])
        if mode == "resume":
            train(model, optimizer, scaler, 40, 80)
        else:  # plain torch: the state loads (cast to the parameters' float16, as torch does)
            state = optimizer.state_dict()["state"]
            assert set(state) == {0, 1, 2, 3} and state[0]["exp_avg"].dtype == torch.float16, state[0]
            assert scaler.get_scale() == checkpoint["scaler"]["scale"]
    torch.save({"params": [p.detach() for p in model.parameters()], "optimizer": optimizer.state_dict()}, out)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:4])
