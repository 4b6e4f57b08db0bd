"""fp32 masters through what happens in real runs, each against the float32 run with the same event.

An exception inside ``optimizer.step()``, one parameter in two optimizers (or
two Parameters over one tensor), a copy of the optimizer (deepcopy, pickle,
``torch.save``), a model rolled back to a checkpoint without its optimizer:
torch carries on from each, and so must the masters (issue 20, items 1-4); so must a copy of two optimizers
sharing a parameter, and an ``ampguard.uninstall()`` between ``unscale_`` and ``step``.
Parameters and optimizer state are compared after the event and 20 steps later.
"""

from __future__ import annotations

import copy
import importlib
import io
import logging
import pickle

import pytest
import torch
import torch.nn.functional as F
import torch.optim.optimizer as optimizer_module
from master_events_support import Run, assert_like, batch, model_lists, model_of, sgd
from master_support import OwnStateDictSGD
from scaler_support import (  # noqa: F401
    ampguard_log,
    one_thread,
    records,
)

import ampguard
from ampguard import master_weights

pytestmark = pytest.mark.usefixtures("one_thread")


def pair(make_optimizers=lambda model: [sgd(model.parameters())], **run) -> tuple[Run, Run]:
    """The float16 run (with masters) and the float32 run, from the same start."""
    runs = []
    for dtype in (torch.float16, torch.float32):
        model = model_of(dtype)
        runs.append(Run(model, make_optimizers(model), dtype, **run))
    return runs[0], runs[1]


# -- 1. an exception inside optimizer.step() ------------------------------------------


def _raise_in_step_hook(optimizer: torch.optim.Optimizer, where: str) -> None:
    """One exception from a step hook of ``optimizer`` (torch's step wrapper skips the post-hooks)."""

    def hook(*args):
        handle.remove()
        raise RuntimeError("a step hook failed")

    register = optimizer.register_step_pre_hook if where == "pre_hook" else optimizer.register_step_post_hook
    handle = register(hook)


def _interrupt_second_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C in the middle of SGD's step: the first group is updated, the second is not (torch's partial step)."""
    calls = []
    module = importlib.import_module("torch.optim.sgd")
    functional = module.sgd

    def sgd_then_interrupt(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return functional(*args, **kwargs)

    monkeypatch.setattr(module, "sgd", sgd_then_interrupt)


@pytest.mark.parametrize("where", ["pre_hook", "post_hook", "inside_step"])
def test_an_exception_in_a_step_leaves_the_optimizer_as_torch_and_training_goes_on(where, monkeypatch):
    def two_groups(model):
        return [sgd([{"params": model[0].parameters()}, {"params": model[2].parameters()}])]

    half, full = pair(two_groups)
    for run in (half, full):
        run.steps(5)
        if where == "inside_step":
            _interrupt_second_group(monkeypatch)
        else:
            _raise_in_step_hook(run.optimizers[0], where)
        with pytest.raises((RuntimeError, KeyboardInterrupt)):
            run.steps(1)
        monkeypatch.undo()
        assert model_lists(run) == [[id(p) for p in run.model[i].parameters()] for i in (0, 2)]
    assert_like(half, full)  # the parameters hold what the (partial) step wrote, as torch's in-place step
    half.steps(20)
    full.steps(20)
    assert_like(half, full)
    assert {id(p) for p, _ in master_weights.masters_of(half.optimizers[0])} == {id(p) for p in half.model.parameters()}


def test_a_step_that_raised_under_a_grad_scaler_can_be_taken_again():
    """The gradients the scaler unscaled into the masters stay for the retry, as p.grad stays in torch."""
    results = {}
    for dtype in (torch.float16, torch.float32):
        model = model_of(dtype)
        optimizer = sgd(model.parameters())
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        run = Run(model, [optimizer], dtype)
        run.steps(3)
        x, y = torch.ones(8, 16, dtype=dtype), torch.zeros(8, 4)
        optimizer.zero_grad()
        scaler.scale(run.loss_of(model, x, y)).backward()
        _raise_in_step_hook(optimizer, "pre_hook")
        with pytest.raises(RuntimeError):
            scaler.step(optimizer)
        scaler.step(optimizer)  # the retry
        scaler.update()
        results[dtype] = run
    assert_like(results[torch.float16], results[torch.float32])


# -- 2. one parameter in two optimizers; two Parameters over one tensor ---------------


def test_a_parameter_in_two_optimizers_gets_both_updates_like_torch():
    """A shared trunk (model[0]) stepped by two optimizers, each with its own head and momentum."""

    def two_optimizers(model):
        return [sgd([*model[0].parameters(), model[2].weight]), sgd([*model[0].parameters(), model[2].bias])]

    half, full = pair(two_optimizers)
    for count in (1, 20):
        half.steps(count)
        full.steps(count)
        assert_like(half, full)


def test_a_parameter_in_two_optimizers_is_clipped_once_for_both_under_a_grad_scaler():
    """unscale_ of each optimizer, then one clip_grad_norm_ over the model, then both steps (torch would unscale the
    shared p.grad twice: the reference is float32 without a scaler). Both optimizers step the clipped gradient."""
    runs = {}
    for dtype in (torch.float16, torch.float32):
        model = model_of(dtype)
        optimizers = [sgd([*model[0].parameters(), model[2].weight]), sgd([*model[0].parameters(), model[2].bias])]
        runs[dtype] = run = Run(model, optimizers, dtype)
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0) if dtype == torch.float16 else None
        for _ in range(10):
            for optimizer in optimizers:
                optimizer.zero_grad()
            x, y = batch(run.step, dtype)
            loss = run.loss_of(model, x, y)
            if scaler is None:
                loss.backward()
            else:
                scaler.scale(loss).backward()
                for optimizer in optimizers:
                    scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            for optimizer in optimizers:
                optimizer.step() if scaler is None else scaler.step(optimizer)
            if scaler is not None:
                scaler.update()
            run.step += 1
    assert_like(runs[torch.float16], runs[torch.float32])


class TwoViews(torch.nn.Module):
    """A second Parameter over the first layer's weight: all of it, or its first 4 rows (``view`` shares its memory)."""

    def __init__(self, dtype: torch.dtype, rows: bool) -> None:
        super().__init__()
        self.inner = model_of(dtype)
        weight = self.inner[0].weight.detach()
        self.rows = rows
        self.view = torch.nn.Parameter(weight[:4] if rows else weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows:
            return self.inner(x) + torch.tanh(x) @ self.view.T * 0.5
        return self.inner(x + torch.tanh(x) @ self.view.T * 0.5)


@pytest.mark.parametrize("view", ["whole", "rows"])
@pytest.mark.parametrize("optimizers", ["one", "two"])
def test_two_parameters_over_one_tensor_both_update_it_like_torch(optimizers, view):
    runs = []
    for dtype in (torch.float16, torch.float32):
        model = TwoViews(dtype, rows=view == "rows")
        one = [sgd([model.view, *model.inner.parameters()])] if optimizers == "one" else None  # the slice first
        made = one or [sgd(model.inner.parameters()), sgd([model.view])]
        runs.append(Run(model, made, dtype))
    half, full = runs
    for count in (1, 20):
        half.steps(count)
        full.steps(count)
        assert_like(half, full)
        assert half.model.view.data_ptr() == half.model.inner[0].weight.data_ptr()


def test_a_parameter_straddling_another_ones_memory_is_refused_by_name(ampguard_log):
    memory = torch.randn(24, dtype=torch.float16)
    first, second = torch.nn.Parameter(memory[:16]), torch.nn.Parameter(memory[8:])
    optimizer = sgd([first, second])
    (first.float().sum() + second.float().sum()).backward()
    optimizer.step()
    [warning] = records(ampguard_log, logging.WARNING, "cannot keep float32 master weights")
    assert "param_groups[0]['params'][1] (float16, shape [16])" in warning.getMessage()
    assert not master_weights.masters_of(optimizer)
    assert optimizer.param_groups[0]["params"][1] is second and second.grad is not None


# -- 3. copies of the optimizer -------------------------------------------------------


def _deepcopy(objects):
    return copy.deepcopy(objects)


def _pickle(objects):
    return pickle.loads(pickle.dumps(objects))


def _torch_save(objects):
    buffer = io.BytesIO()
    torch.save(objects, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("how", [_deepcopy, _pickle, _torch_save], ids=["deepcopy", "pickle", "torch_save"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_copy_of_the_optimizer_continues_exactly_as_the_original(how, optimizer):
    def make(model):
        if optimizer == "sgd":
            return [sgd(model.parameters())]
        return [torch.optim.AdamW(model.parameters(), lr=1e-2)]

    half, full = pair(make)
    for run in (half, full):
        run.steps(5)
    model, optimizers = how((half.model, half.optimizers))
    copied = Run(model, optimizers, torch.float16, step=half.step)
    for run in (half, copied, full):
        run.steps(20)
    if optimizer == "sgd":  # AdamW's float16 and float32 runs part by more than rounding where gradients are ~0
        assert_like(copied, full)
    assert all(torch.equal(p, q) for p, q in zip(half.model.parameters(), copied.model.parameters()))
    assert str(half.optimizers[0].state_dict()) == str(copied.optimizers[0].state_dict())


# -- 4. a model loaded in the middle of training --------------------------------------


def test_a_model_rolled_back_without_its_optimizer_trains_from_what_was_loaded():
    half, full = pair()
    for run in (half, full):
        run.steps(5)
        best = copy.deepcopy(run.model.state_dict())
        run.steps(10)
        run.model.load_state_dict(best)  # back to the best checkpoint; the optimizer keeps its state
    assert_like(half, full)
    for count in (1, 20):
        half.steps(count)
        full.steps(count)
        assert_like(half, full)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_an_optimizer_saved_whole_with_masters_loads_and_steps_in_plain_torch(optimizer):
    model = model_of(torch.float16)
    made = sgd(model.parameters()) if optimizer == "sgd" else torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = Run(model, [made], torch.float16)
    run.steps(3)
    saved = io.BytesIO()
    torch.save((model, made), saved)
    ampguard.uninstall()
    try:
        saved.seek(0)
        model, loaded = torch.load(saved, weights_only=False)
        state = loaded.state_dict()["state"]  # keyed by the parameters: torch finds every one
        assert sorted(state) == [0, 1, 2, 3] and all(len(s) > 0 for s in state.values())
        assert all(t.dtype == torch.float16 for s in state.values() for k, t in s.items() if k != "step")
        Run(model, [loaded], torch.float16, step=3).steps(2)  # (AdamW's float16 state then makes NaN, as in torch)
        assert optimizer == "adamw" or all(torch.isfinite(p).all() for p in model.parameters())
    finally:
        ampguard.install()


def test_a_step_captured_before_install_that_raised_is_put_back_at_the_next_call(monkeypatch):
    """torch's hooked step held from before ``import ampguard`` (an LR scheduler made earlier) has no put-back of
    its own: the next call into the optimizer (here zero_grad) puts the model's parameters back."""
    half, full = pair()
    for run in (half, full):
        optimizer = run.optimizers[0]
        hooked = vars(type(optimizer))["step"]
        torch_hooked = hooked.__wrapped__ if hasattr(hooked, "_ampguard_puts_masters_back") else hooked
        monkeypatch.setattr(optimizer, "step", torch_hooked.__get__(optimizer))
        run.steps(5)
        _raise_in_step_hook(optimizer, "post_hook")
        with pytest.raises(RuntimeError):
            run.steps(1)
        optimizer.zero_grad()
        assert model_lists(run) == [[id(p) for p in run.model.parameters()]]
    assert_like(half, full)
    half.steps(20)
    full.steps(20)
    assert_like(half, full)


def test_an_optimizers_own_step_post_hook_sees_the_model_after_the_step():
    """torch runs the optimizer's own post-hooks before the global ones (an EMA update, a logger hooked there)."""
    seen = {}
    for run in pair():
        optimizer, dtype = run.optimizers[0], run.dtype

        def hook(optimizer, args, kwargs, dtype=dtype, model=run.model):
            params = optimizer.param_groups[0]["params"]
            assert all(p is q for p, q in zip(params, model.parameters()))
            seen[dtype] = [p.detach().clone() for p in params]

        optimizer.register_step_post_hook(hook)
        run.steps(3)
        assert all(torch.equal(a, b) for a, b in zip(seen[dtype], run.model.parameters()))
    assert all(torch.allclose(a.float(), b, atol=2e-3) for a, b in zip(seen[torch.float16], seen[torch.float32]))


@pytest.mark.parametrize("scaler", [False, True], ids=["plain_step", "grad_scaler"])
def test_a_parameter_also_stepped_by_an_optimizer_without_masters_keeps_its_updates(scaler):
    """The other optimizer steps between the masters' gradient copy (unscale_) and their step, or after it."""
    runs = {}
    for dtype in (torch.float16, torch.float32):
        model = model_of(dtype)
        masters, direct = sgd(model.parameters()), OwnStateDictSGD([model[0].weight], lr=0.05)
        runs[dtype] = run = Run(model, [masters, direct], dtype)
        grad_scaler = torch.amp.GradScaler("cpu", init_scale=256.0) if scaler and dtype == torch.float16 else None
        for _ in range(20):
            masters.zero_grad()
            direct.zero_grad()
            x, y = batch(run.step, dtype)
            loss = run.loss_of(model, x, y)
            if grad_scaler is None:
                loss.backward()
                masters.step()
                direct.step()
            else:
                grad_scaler.scale(loss).backward()
                grad_scaler.unscale_(masters)
                grad_scaler.step(direct)
                grad_scaler.step(masters)
                grad_scaler.update()
            run.step += 1
    assert_like(runs[torch.float16], runs[torch.float32], tolerance=3e-3)  # the float16 optimizer's own rounding


# -- 5. a copy (deepcopy, pickle) of two optimizers sharing a parameter ----------------------
# The originals step one float32 copy of the shared memory, so both updates are kept; a ``copy.deepcopy`` or pickle
# of the model with both optimizers must go on doing that, as torch's copy (one Parameter in both optimizers) does.


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_two_optimizers_sharing_a_parameter_keeps_both_updates(how):
    copies = []
    for dtype in (torch.float16, torch.float32):
        model = model_of(dtype)
        optimizers = [sgd(model.parameters()), sgd(list(model.parameters())[:2])]
        run = Run(model, optimizers, dtype)
        run.steps(3)
        pair = (model, optimizers)
        model, optimizers = copy.deepcopy(pair) if how == "deepcopy" else pickle.loads(pickle.dumps(pair))
        copied = Run(model, optimizers, dtype, run.step)
        copied.steps(3)
        copies.append(copied)
    assert_like(*copies)


# -- 6. ampguard.uninstall() with masters live -----------------------------------------------
# After ``scaler.unscale_(optimizer)`` the unscaled gradients are the masters' (the parameters' ``.grad`` keep the
# scaled float16 values). Switched off before ``scaler.step``, the optimizer must step with the unscaled gradients,
# as the float32 run does, not with gradients still multiplied by the scale.


def _update_after_unscale(dtype: torch.dtype, uninstall: str | None) -> list[torch.Tensor]:
    """The parameters after one step of the float16 or float32 model, unscaled first, with ``ampguard.uninstall()``
    called ``uninstall``: "before step" (between ``unscale_`` and ``step``), or from inside the step, by a step hook of
    the user's: "optimizer pre-hook" (before the masters' own, the last), "global pre-hook", "post-hook"."""
    model = model_of(dtype)
    optimizer = sgd(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x, y = batch(0, dtype)
    scaler.scale(F.mse_loss(model(x).float(), y)).backward()
    scaler.unscale_(optimizer)
    hooks = {
        "optimizer pre-hook": optimizer.register_step_pre_hook,
        "global pre-hook": optimizer_module.register_optimizer_step_pre_hook,
        "post-hook": optimizer.register_step_post_hook,
    }
    handle = hooks[uninstall](lambda *args: ampguard.uninstall()) if uninstall in hooks else None
    if uninstall == "before step":
        ampguard.uninstall()
    try:
        scaler.step(optimizer)
    finally:
        if handle is not None:
            handle.remove()
        ampguard.install()
    return [p.detach().float().clone() for p in model.parameters()]


def test_uninstall_between_unscale_and_step_steps_with_the_unscaled_gradients():
    start = [p.detach().float() for p in model_of(torch.float32).parameters()]
    half = _update_after_unscale(torch.float16, uninstall="before step")
    full = _update_after_unscale(torch.float32, uninstall=None)
    largest = [max((p - s).abs().max().item() for p, s in zip(run, start)) for run in (half, full)]
    assert largest[0] == pytest.approx(largest[1], rel=0.05), f"largest update {largest} in float16, float32"


@pytest.mark.parametrize("hook", ["optimizer pre-hook", "global pre-hook"])
def test_uninstall_from_a_step_pre_hook_steps_as_uninstalled_before_the_step(hook):
    """torch iterates the step hooks as it steps: the masters' hooks leave once the step has ended, never from under
    that iteration ("OrderedDict mutated during iteration" raised into the user's step before)."""
    global_hooks = optimizer_module._global_optimizer_pre_hooks, optimizer_module._global_optimizer_post_hooks
    ampguard.uninstall()
    stock = [len(hooks) for hooks in global_hooks]
    ampguard.install()
    inside = _update_after_unscale(torch.float16, uninstall=hook)
    before = _update_after_unscale(torch.float16, uninstall="before step")
    assert all(torch.equal(a, b) for a, b in zip(inside, before))
    ampguard.uninstall()
    assert [len(hooks) for hooks in global_hooks] == stock  # none of ampguard's left behind


def test_uninstall_from_a_step_post_hook_keeps_the_step_the_masters_took():
    after = _update_after_unscale(torch.float16, uninstall="post-hook")
    plain = _update_after_unscale(torch.float16, uninstall=None)
    assert all(torch.equal(a, b) for a, b in zip(after, plain))
