"""fp32 master weights for ``optimizer.step(closure)``: SGD, AdamW and LBFGS on a float16 model, against float32.

The reference is the same fine-tune (tests/support/master_support.py) with a float32
student started from the same rounded weights and fed the same data, stepped
with the same closure. Without masters float16 AdamW and LBFGS end with NaN
weights and float16 SGD keeps a few percent of the progress.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from master_support import fine_tune
from scaler_support import ampguard_log, records  # noqa: F401

from ampguard import master_weights
from ampguard.master_weights import gradient_copies
from ampguard.syncs import HostReadCounter

CASES = [("sgd", 1e-3, 200), ("adamw", 1e-4, 200), ("lbfgs", 1.0, 20)]


@pytest.mark.parametrize(("optimizer", "lr", "steps"), CASES, ids=[case[0] for case in CASES])
def test_closure_steps_train_a_float16_model_like_float32(optimizer, lr, steps):
    reference = fine_tune(
        torch.float32, optimizer, lr, steps=steps, scaler=False, closure=True, start_like=torch.float16
    )
    half = fine_tune(torch.float16, optimizer, lr, steps=steps, scaler=False, closure=True)
    assert half.finite() and half.dtypes() == {torch.float16}
    assert len(master_weights.masters_of(half.optimizer)) == 2
    assert half.reduction == pytest.approx(reference.reduction, rel=1e-3)
    # Under fp16 autocast the float32 student computes with the same rounded weights: its weights are the masters.
    masters = {id(p): m for p, m in master_weights.masters_of(half.optimizer)}
    for name in ("weight", "bias"):
        stepped = masters[id(getattr(half.model, name))]
        torch.testing.assert_close(stepped, getattr(reference.model, name), rtol=0, atol=1e-7)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_closure_step_is_the_step_without_one(optimizer):
    """The closure path gives the masters exactly what ``loss.backward(); opt.step()`` does."""
    plain = fine_tune(torch.float16, optimizer, 1e-3, steps=30, scaler=False)
    stepped = fine_tune(torch.float16, optimizer, 1e-3, steps=30, scaler=False, closure=True)
    masters = [m for _, m in master_weights.masters_of(stepped.optimizer)]
    assert len(masters) == 2
    assert all(torch.equal(a, b) for (_, a), b in zip(master_weights.masters_of(plain.optimizer), masters, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), stepped.model.parameters()))


def test_each_lbfgs_evaluation_sees_the_masters_so_far_and_feeds_their_gradients():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1).half()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=6)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    seen: list[tuple[bool, bool | None, bool]] = []  # (params == rounded masters, master grads == last ones, moved)
    last: dict[str, list[torch.Tensor]] = {}

    def closure() -> torch.Tensor:
        pairs = master_weights.masters_of(opt)
        assert len(pairs) == 2
        current = all(torch.equal(p, m.to(p.dtype)) for p, m in pairs)
        fed = all(torch.equal(m.grad, g) for (_, m), g in zip(pairs, last["grads"])) if last else None
        moved = bool(last) and not all(torch.equal(m, b) for (_, m), b in zip(pairs, last["masters"]))
        seen.append((current, fed, moved))
        opt.zero_grad()
        loss = F.mse_loss(model(x.half()).float(), y)
        loss.backward()
        last["grads"] = [p.grad.float() for p, _ in pairs]
        last["masters"] = [m.detach().clone() for _, m in pairs]
        return loss

    for _ in range(2):
        last.clear()  # the masters' gradients are freed after each step
        opt.step(closure)
    assert len(seen) > 4 and all(current for current, _, _ in seen)
    assert all(fed for _, fed, _ in seen if fed is not None) and any(moved for _, _, moved in seen)
    assert sum(fed is not None for _, fed, _ in seen) >= 2  # evaluations after the first of a step were checked
    params = opt.param_groups[0]["params"]
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True)) and opt._params is params
    assert opt.state[master_weights.masters_of(opt)[0][1]]["d"].dtype == torch.float32  # its history is the masters'


def test_a_closure_step_gets_the_info_line_and_no_cannot_wrap_warning(ampguard_log):
    fine_tune(torch.float16, "adamw", 1e-4, steps=3, scaler=False, closure=True)
    assert len(records(ampguard_log, logging.INFO, "keeps float32 master copies")) == 1
    assert not records(ampguard_log, logging.WARNING)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "lbfgs"])
def test_host_reads_per_closure_step_with_masters_at_most_the_float32_model(optimizer, reinstall):
    reinstall(AMPGUARD_STATS_EVERY="0")
    lr = 1.0 if optimizer == "lbfgs" else 1e-4
    counts = {}
    for dtype in (torch.float32, torch.float16):
        fine_tune(dtype, optimizer, lr, steps=2, scaler=False, closure=True)  # masters made, first-step work done
        with HostReadCounter() as reads:
            run = fine_tune(dtype, optimizer, lr, steps=10, scaler=False, closure=True)
        assert len(master_weights.masters_of(run.optimizer)) == (2 if dtype == torch.float16 else 0)
        with HostReadCounter() as baseline:
            fine_tune(dtype, optimizer, lr, steps=0, scaler=False, closure=True)
        counts[dtype] = reads.total - baseline.total  # the held-out losses are read in both
    assert counts[torch.float16] <= counts[torch.float32]
    if optimizer == "lbfgs":
        assert counts[torch.float32] >= 10  # LBFGS reads the loss each step: the counter works here


def test_a_parameter_unfrozen_between_closure_steps_gets_its_master_at_the_next_step():
    """The gradients only exist inside the closure (zero_grad before each step): requires_grad tells."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).half()
    model[0].requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8, dtype=torch.float16)

    def closure() -> torch.Tensor:
        loss = model(x).float().square().mean()
        loss.backward()
        return loss

    for unfrozen in (False, True):
        if unfrozen:
            model[0].requires_grad_(True)
        opt.zero_grad()
        opt.step(closure)
    assert {id(p) for p, _ in master_weights.masters_of(opt)} == {id(p) for p in model.parameters()}
    assert all(m.dtype == torch.float32 for m in opt.state) and len(opt.state) == 4
    assert all(p.dtype == torch.float16 and torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("optimizer", ["sgd", "lbfgs"])
def test_a_failure_inside_a_closure_step_falls_back_to_torch_with_one_warning(optimizer, monkeypatch, ampguard_log):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(gradient_copies, "copy_gradients", broken)
    lr = 1.0 if optimizer == "lbfgs" else 1e-3
    run = fine_tune(torch.float16, optimizer, lr, steps=5, scaler=False, closure=True)
    [warning] = records(ampguard_log, logging.WARNING, "master weights failed")
    assert "RuntimeError: boom" in warning.getMessage()
    assert not master_weights.masters_of(run.optimizer) and run.dtypes() == {torch.float16}
    params = run.optimizer.param_groups[0]["params"]
    assert all(a is b for a, b in zip(params, run.model.parameters(), strict=True))
    assert set(run.optimizer.state) <= set(params)  # the state is the parameters' again, as torch has it
    assert run.end_loss != run.start_loss  # stepped, as torch steps float16 weights


def test_lbfgs_history_lists_go_back_to_the_parameters_dtype_at_uninstall():
    """LBFGS keeps its curvature history in lists (``old_dirs``, ``old_stps``, ``ro``): they leave the masters with
    the rest of its state. A float32 entry left among float16 ones raised 'expected both vectors to have same
    dtype' at the first step after ``uninstall()``."""
    import ampguard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).half()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    x, y = torch.randn(32, 8).half(), torch.randn(32, 4)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        return loss

    optimizer.step(closure)
    ampguard.uninstall()
    try:
        optimizer.step(closure)  # raised before
        state = optimizer.state[optimizer._params[0]]
    finally:
        ampguard.install()
    history = [t for key in ("old_dirs", "old_stps", "ro") for t in state[key]]
    assert history and {t.dtype for t in history} == {torch.float16}
