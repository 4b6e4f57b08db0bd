"""Checkpoints with master weights: exact resume in a new process, loadable by plain torch and from plain torch.

:data:`WORKER` is run as a separate Python process for each part (``full``,
``first``, ``resume``, ``plain_load``): 80 uninterrupted steps must equal 40
steps, a checkpoint saved with ``torch.save`` and loaded in a new process with
``weights_only=True``, and 40 more steps, bit for bit (parameters and optimizer
state). The training loop has the usual recipe (scale, unscale_, clip, step,
update) and an injected overflow on each side of the checkpoint.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import torch

import ampguard
from ampguard import master_weights

WORKER = r"""
import sys

MODE, CHECKPOINT, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
if MODE != "plain_load":
    import ampguard  # noqa: F401
import torch
import torch.nn.functional as F

torch.set_num_threads(1)
FAULTS = {13, 57}


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).half()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=4096.0, growth_interval=10)
    return model, optimizer, scaler


def train(model, optimizer, scaler, start, stop):
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


model, optimizer, scaler = build()
if MODE == "full":
    train(model, optimizer, scaler, 0, 80)
elif MODE == "first":
    train(model, optimizer, scaler, 0, 40)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()}, CHECKPOINT)
    sys.exit(0)
else:
    checkpoint = torch.load(CHECKPOINT, weights_only=True)
    # the optimizer first, the model after it: the order must not matter
    optimizer.load_state_dict(checkpoint["optimizer"])
    model.load_state_dict(checkpoint["model"])
    scaler.load_state_dict(checkpoint["scaler"])
    if MODE == "resume":
        train(model, optimizer, scaler, 40, 80)
    else:  # plain torch: the state loads (cast to the parameters' float16, as torch does)
        state = optimizer.state_dict()["state"]
        assert set(state) == {0, 1, 2, 3} and state[0]["exp_avg"].dtype == torch.float16, state[0]
        assert scaler.get_scale() == checkpoint["scaler"]["scale"]
torch.save({"params": [p.detach() for p in model.parameters()], "optimizer": optimizer.state_dict()}, OUT)
"""


def _run(tmp_path: Path, mode: str) -> Path:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / f"{mode}.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPGUARD")}
    env.update(AMPGUARD_QUIET="1", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, str(script), mode, str(tmp_path / "checkpoint.pt"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_resume_in_a_new_process_is_bit_exact_and_loads_in_plain_torch(tmp_path):
    full = torch.load(_run(tmp_path, "full"), weights_only=True)
    _run(tmp_path, "first")
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    saved = checkpoint["optimizer"]
    assert set(saved[master_weights.STATE_KEY]) == {0, 1, 2, 3}
    assert all(t.dtype == torch.float32 for t in saved[master_weights.STATE_KEY].values())
    assert saved["state"][0]["exp_avg_sq"].dtype == torch.float32
    resumed = torch.load(_run(tmp_path, "resume"), weights_only=True)
    assert all(p.dtype == torch.float16 for p in full["params"])
    assert _equal(full["params"], resumed["params"])
    assert _equal(full["optimizer"], resumed["optimizer"])  # state and masters too
    assert not _equal(full["params"], torch.load(tmp_path / "checkpoint.pt", weights_only=True)["model"])
    _run(tmp_path, "plain_load")


def test_checkpoint_saved_without_ampguard_loads_and_rebuilds_the_masters(stock_torch):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 8, dtype=torch.float16)).float().square().mean().backward()
        optimizer.step()
    saved_model, saved_optimizer = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    assert master_weights.STATE_KEY not in saved_optimizer
    ampguard.install()

    torch.manual_seed(1)  # other initial weights: the model is loaded only after the optimizer
    fresh = torch.nn.Linear(8, 8).half()
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.0, momentum=0.9)
    fresh_optimizer.load_state_dict(saved_optimizer)
    fresh.load_state_dict(saved_model)
    assert all(s["momentum_buffer"].dtype == torch.float32 for s in fresh_optimizer.state.values())
    fresh_optimizer.zero_grad()
    fresh(torch.randn(4, 8, dtype=torch.float16)).float().square().mean().backward()
    fresh_optimizer.step()  # lr 0: the parameters stay what was loaded
    pairs = master_weights.masters_of(fresh_optimizer)
    assert len(pairs) == 2
    assert all(torch.equal(m, saved_model[name].float()) for (p, m), name in zip(pairs, ("weight", "bias")))
    assert all(torch.equal(p, saved_model[name]) for p, name in zip(fresh.parameters(), ("weight", "bias")))


def test_masters_loaded_with_the_optimizer_survive_a_later_model_load():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8).half()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 8, dtype=torch.float16)).float().square().mean().backward()
        optimizer.step()
    state = copy.deepcopy(optimizer.state_dict())
    model_state = copy.deepcopy(model.state_dict())
    masters = [m.clone() for _, m in master_weights.masters_of(optimizer)]
    assert any(not torch.equal(m, p.float()) for m, p in zip(masters, model.parameters()))  # more than the rounding

    other = torch.nn.Linear(8, 8).half()
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=0.0)
    other_optimizer.load_state_dict(state)
    other.load_state_dict(model_state)
    other_optimizer.zero_grad()
    other(torch.randn(4, 8, dtype=torch.float16)).float().square().mean().backward()
    other_optimizer.param_groups[0]["lr"] = 0.0
    other_optimizer.step()
    assert all(torch.equal(m, n) for m, (_, n) in zip(masters, master_weights.masters_of(other_optimizer)))


def test_adagrad_state_made_in_its_constructor_moves_to_the_masters():
    """Adagrad makes its ``sum`` in ``__init__``, before any master exists: that state goes with the masters.

    Found by tests/parity/test_differential.py: ``state_dict()`` raised KeyError (state keyed by a float16 parameter
    that is not among the masters the state is saved by). The reference is the master-weight recipe in plain
    torch: Adagrad over a float32 copy of the float16 weight, fed the float16 gradient of the scaled loss, in
    float32, times the inverse scale; the weight receives the rounded master after each step.
    """
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(3, 4, generator=generator).half()
    data = [torch.randn(3, 4, generator=generator) for _ in range(3)]

    weight = start.clone().requires_grad_()
    optimizer = torch.optim.Adagrad([weight], lr=0.1, initial_accumulator_value=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=100)
    for x in data:
        scaler.scale(torch.tanh(weight.float() * x).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    state = optimizer.state_dict()["state"][0]

    model_weight = start.clone().requires_grad_()
    master_weight = start.float().requires_grad_()
    reference = torch.optim.Adagrad([master_weight], lr=0.1, initial_accumulator_value=0.5)
    for x in data:
        (torch.tanh(model_weight.float() * x).sum() * 1024.0).backward()
        master_weight.grad = model_weight.grad.float() * (1 / 1024.0)
        model_weight.grad = None
        reference.step()
        with torch.no_grad():
            model_weight.copy_(master_weight)
    want = reference.state_dict()["state"][0]
    assert torch.equal(state["sum"], want["sum"]) and state["sum"].dtype == torch.float32
    assert torch.equal(state["step"], want["step"])
    assert torch.equal(weight, model_weight)
