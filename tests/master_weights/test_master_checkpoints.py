"""Checkpoints with master weights: exact resume in a new process, loadable by plain torch and from plain torch.

tests/master_weights/master_checkpoint_worker.py trains: 80 uninterrupted steps (``full``) must equal 40 steps
(``first``), a checkpoint saved with ``torch.save`` and loaded in a new process with ``weights_only=True``, and 40
more steps (``resume``), bit for bit (parameters and optimizer state); a new process of plain torch loads the
checkpoint (``plain_load``). ``full`` and ``first`` run in the test's process, under ampguard's default
installation, as in the new processes; only what must be new (the resume, plain torch) starts one. The training
loop has the usual recipe (scale, unscale_, clip, step, update) and an injected overflow on each side of the
checkpoint.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import master_checkpoint_worker
import torch

import ampguard
from ampguard import master_weights

WORKER = Path(master_checkpoint_worker.__file__)


def _run(tmp_path: Path, mode: str) -> Path:
    """The worker's ``mode`` in a new Python process (ampguard's default installation, or plain torch)."""
    out = tmp_path / f"{mode}.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPGUARD")}
    env.update(AMPGUARD_QUIET="1", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, str(WORKER), mode, str(tmp_path / "checkpoint.pt"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def _run_here(tmp_path: Path, mode: str) -> Path:
    """The worker's ``mode`` in this process, under ampguard's default installation as in :func:`_run`."""
    out = tmp_path / f"{mode}.pt"
    master_checkpoint_worker.main(mode, str(tmp_path / "checkpoint.pt"), str(out))
    return out


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_resume_in_a_new_process_is_bit_exact_and_loads_in_plain_torch(tmp_path, monkeypatch, reinstall):
    monkeypatch.delenv("AMPGUARD_UNDERFLOW")  # the default policy, as in the new processes (tests/conftest.py)
    reinstall()
    full = torch.load(_run_here(tmp_path, "full"), weights_only=True)
    _run_here(tmp_path, "first")
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
