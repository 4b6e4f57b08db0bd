"""fp32 master weights: half-precision models train like fp32, the user's objects keep working, free on fp32.

The reference is always the same fine-tune with a float32 student (see
tests/support/master_support.py). ``AMPGUARD_MASTER_WEIGHTS=off`` runs show that the
criteria fail without master weights.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch
import torch.nn.functional as F
from master_support import WIDTH, OwnStateDictSGD, fine_tune
from scaler_support import ampguard_log, fused_adam_available, one_thread, records  # noqa: F401

import ampguard
from ampguard import master_weights
from ampguard.master_weights import gradient_copies
from ampguard.scaler import listeners
from ampguard.syncs import HostReadCounter

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = [("adamw", 1e-4), ("adamw", 1e-5), ("sgd", 1e-3)]
_references: dict[tuple, float] = {}


def reference_reduction(optimizer: str, lr: float, scaler: bool, half: torch.dtype = torch.float16) -> float:
    """The float32 student's loss reduction, from the same (rounded) start as the ``half`` student."""
    key = (optimizer, lr, scaler, half)
    if key not in _references:
        _references[key] = fine_tune(torch.float32, optimizer, lr, scaler=scaler, start_like=half).reduction
    assert _references[key] > 0
    return _references[key]


@pytest.mark.parametrize("scaler", [True, False], ids=["grad_scaler", "plain_step"])
@pytest.mark.parametrize("optimizer,lr", CASES)
def test_float16_student_learns_like_float32(optimizer, lr, scaler):
    half = fine_tune(torch.float16, optimizer, lr, scaler=scaler)
    assert half.finite() and half.dtypes() == {torch.float16}
    assert half.reduction >= 0.9 * reference_reduction(optimizer, lr, scaler)
    for param, copy in master_weights.masters_of(half.optimizer):
        assert copy.dtype == torch.float32 and torch.equal(copy.to(torch.float16), param)
    assert all(
        t.dtype == torch.float32 for s in half.optimizer.state.values() for t in s.values() if t.is_floating_point()
    )


@pytest.mark.parametrize("scaler", [True, False], ids=["grad_scaler", "plain_step"])
@pytest.mark.parametrize("optimizer,lr", CASES)
def test_bfloat16_student_learns_like_float32_with_all(optimizer, lr, scaler, reinstall):
    reinstall(AMPGUARD_MASTER_WEIGHTS="all")
    half = fine_tune(torch.bfloat16, optimizer, lr, scaler=scaler)
    assert half.finite() and half.dtypes() == {torch.bfloat16}
    assert half.reduction >= 0.9 * reference_reduction(optimizer, lr, scaler, torch.bfloat16)


@pytest.mark.parametrize("mode,dtype", [("off", torch.float16), ("fp16", torch.bfloat16)])
def test_without_masters_the_same_criteria_fail(mode, dtype, reinstall):
    """The criteria above can fail: float16 AdamW dies, bfloat16 at lr 1e-5 (default mode: fp16 only) barely moves."""
    reinstall(AMPGUARD_MASTER_WEIGHTS=mode)
    lr = 1e-4 if dtype == torch.float16 else 1e-5
    half = fine_tune(torch.float16 if mode == "off" else dtype, "adamw", lr, scaler=False)
    assert not master_weights.masters_of(half.optimizer)
    assert not half.finite() or half.reduction < 0.5 * reference_reduction("adamw", lr, False, dtype)


@pytest.mark.skipif(not fused_adam_available(), reason="AdamW(fused=True) has no CPU kernel in this torch")
def test_fused_adamw_steps_the_masters_under_a_grad_scaler():
    half = fine_tune(torch.float16, "adamw_fused", 1e-4)
    assert half.finite() and half.dtypes() == {torch.float16}
    assert half.reduction >= 0.9 * fine_tune(torch.float32, "adamw_fused", 1e-4).reduction


def test_first_clip_norm_after_unscale_is_the_float32_norm():
    reference = fine_tune(torch.float32, "adamw", 1e-4, steps=3, clip=1.0)
    half = fine_tune(torch.float16, "adamw", 1e-4, steps=3, clip=1.0)
    assert half.norms[0] == pytest.approx(reference.norms[0], rel=0.02)
    # clipping with max_norm below the norm acts on the gradients the optimizer uses (the masters')
    tight = fine_tune(torch.float16, "sgd", 1e-3, steps=1, clip=reference.norms[0] / 4)
    assert tight.norms[0] == pytest.approx(reference.norms[0], rel=0.02)


def _half_linear_unscaled() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
    """A float16 Linear whose SGD's gradients a scaler just unscaled (into the masters)."""
    model = torch.nn.Linear(WIDTH, 4).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(8, WIDTH)).float().square().mean()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    return model, opt, scaler


def test_clip_norm_returned_is_the_norm_of_the_master_gradients():
    model, opt, scaler = _half_linear_unscaled()
    grads = [g for _, g in listeners.gradients(opt)]
    assert all(g.dtype == torch.float32 for g in grads)
    expected = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float(expected) / 2)
    assert torch.allclose(norm, expected)
    clipped = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    assert clipped.item() == pytest.approx(float(expected) / 2, rel=1e-3)
    scaler.step(opt)
    scaler.update()


def test_the_documented_gradients_function_gives_the_tensors_the_step_uses():
    """docs/master-weights.md: ``ampguard.master_weights.gradients(optimizer)`` gives ``(parameter, tensor holding
    its gradient)``, the masters' float32 gradients after ``unscale_`` (it was gone from the package for a while)."""
    model, opt, _ = _half_linear_unscaled()
    pairs = master_weights.gradients(opt)
    masters = dict(master_weights.masters_of(opt))
    assert [id(p) for p, _ in pairs] == [id(p) for p in model.parameters()]
    assert all(g is masters[p].grad and g.dtype == torch.float32 for p, g in pairs)


# -- a frozen float16 base with a trainable float16 adapter ---------------------------

BASE_SHAPE = (48, 40)  # unique in this process: no other tensor has it


class AdaptedLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = torch.nn.Linear(BASE_SHAPE[1], BASE_SHAPE[0])
        self.down = torch.nn.Linear(BASE_SHAPE[1], 4, bias=False)
        self.up = torch.nn.Linear(4, BASE_SHAPE[0], bias=False)
        torch.nn.init.zeros_(self.up.weight)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


def _adapter_run(dtype: torch.dtype, steps: int = 60) -> tuple[float, float, AdaptedLinear, torch.optim.Optimizer]:
    model = AdaptedLinear().to(dtype)
    torch.manual_seed(1)
    target = (
        torch.randn(BASE_SHAPE[0], 4, dtype=torch.float64) @ torch.randn(4, BASE_SHAPE[1], dtype=torch.float64) * 0.05
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # the frozen base too, as many scripts pass it
    scaler = torch.amp.GradScaler("cpu")
    data = torch.Generator().manual_seed(2)
    held_out = torch.randn(128, BASE_SHAPE[1], generator=data)

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x.to(dtype))
        wanted = (x.double() @ target.T).float() + model.base(x.to(dtype)).float().detach()
        return F.mse_loss(out.float(), wanted)

    with torch.no_grad():
        start = loss_of(held_out).item()
    for _ in range(steps):
        opt.zero_grad()
        scaler.scale(loss_of(torch.randn(32, BASE_SHAPE[1], generator=data))).backward()
        scaler.step(opt)
        scaler.update()
    with torch.no_grad():
        end = loss_of(held_out).item()
    return start, end, model, opt


def test_frozen_base_gets_no_float32_copy_and_the_adapter_learns():
    start32, end32, *objects = _adapter_run(torch.float32)
    del objects  # the float32 reference's own base must not count below
    start, end, model, opt = _adapter_run(torch.float16)
    assert end < start and (start - end) >= 0.9 * (start32 - end32)
    copies = master_weights.masters_of(opt)
    assert {id(p) for p, _ in copies} == {id(model.down.weight), id(model.up.weight)}
    gc.collect()
    float32_base_shaped = [
        obj
        for obj in gc.get_objects()
        if type(obj) in (torch.Tensor, torch.nn.Parameter)
        and obj.dtype == torch.float32
        and tuple(obj.shape) == BASE_SHAPE
    ]
    assert float32_base_shaped == []
    assert model.base.weight.dtype == torch.float16 and model.base.weight.grad is None
    assert all(id(p) != id(model.base.weight) for p in opt.state)
    assert set(opt.state_dict()[master_weights.STATE_KEY]) == {2, 3}  # positions of down.weight and up.weight


def test_a_frozen_parameter_that_starts_training_gets_its_master_then():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).half()
    model[0].requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for unfrozen in (False, True):
        if unfrozen:
            model[0].requires_grad_(True)
        opt.zero_grad()
        model(torch.randn(4, 8, dtype=torch.float16)).float().square().mean().backward()
        opt.step()
    assert {id(p) for p, _ in master_weights.masters_of(opt)} == {id(p) for p in model.parameters()}
    assert all(p.dtype == torch.float16 and torch.isfinite(p).all() for p in model.parameters())


# -- what the user holds --------------------------------------------------------------


def _half_step(model: torch.nn.Module, opt: torch.optim.Optimizer, scaler=None) -> None:
    opt.zero_grad()
    loss = model(torch.randn(4, model.in_features, dtype=next(model.parameters()).dtype)).float().square().mean()
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def test_param_groups_zero_grad_schedulers_and_add_param_group_keep_working():
    model = torch.nn.Linear(8, 8).half()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu")
    _half_step(model, opt, scaler)
    scheduler.step()
    assert opt.param_groups[0]["params"] == [model.weight, model.bias] or all(
        a is b for a, b in zip(opt.param_groups[0]["params"], [model.weight, model.bias])
    )
    assert opt.param_groups[0]["lr"] == 5e-4
    assert all(m.grad is None for _, m in master_weights.masters_of(opt))  # freed after the step
    opt.zero_grad()
    assert model.weight.grad is None
    extra = torch.nn.Linear(8, 8).half()
    opt.add_param_group({"params": extra.parameters(), "lr": 1e-3})
    opt.zero_grad()
    (
        model(torch.randn(2, 8, dtype=torch.float16)).sum() + extra(torch.randn(2, 8, dtype=torch.float16)).sum()
    ).float().backward()
    before = extra.weight.detach().clone()
    opt.step()
    assert len(master_weights.masters_of(opt)) == 4 and not torch.equal(before, extra.weight)
    assert all(p is q for p, q in zip(opt.param_groups[1]["params"], extra.parameters()))


def test_zero_grad_clears_master_gradients_left_by_a_skipped_step():
    model = torch.nn.Linear(8, 8).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(2, 8, dtype=torch.float16)).float().sum() * float("inf")).backward()
    scaler.step(opt)  # skipped: the masters' gradients stay until zero_grad
    scaler.update()
    assert any(m.grad is not None for _, m in master_weights.masters_of(opt))
    opt.zero_grad()
    assert all(m.grad is None for _, m in master_weights.masters_of(opt)) and model.weight.grad is None


def test_float32_optimizers_are_untouched_and_bit_identical_to_torch(stock_torch):
    def run() -> tuple[torch.nn.Module, dict]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=100)
        data = torch.Generator().manual_seed(1)
        for _ in range(30):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.randn(8, 8, generator=data))
            scaler.scale(F.mse_loss(out.float(), torch.randn(8, 2, generator=data))).backward()
            scaler.step(opt)
            scaler.update()
        return model, opt.state_dict()

    plain_model, plain_state = run()
    ampguard.install()
    guarded_model, guarded_state = run()
    assert all(torch.equal(p, q) for p, q in zip(plain_model.parameters(), guarded_model.parameters()))
    assert set(guarded_state) == set(plain_state) == {"state", "param_groups"}


def test_uninstall_puts_the_state_back_on_the_parameters():
    model = torch.nn.Linear(8, 8).half()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _half_step(model, opt)
    assert set(map(id, opt.state)) == {id(m) for _, m in master_weights.masters_of(opt)}
    ampguard.uninstall()
    try:
        assert set(map(id, opt.state)) == {id(p) for p in model.parameters()}
        assert all(s["exp_avg"].dtype == torch.float16 for s in opt.state.values())
        assert master_weights.STATE_KEY not in opt.state_dict()
    finally:
        ampguard.install()


# -- messages -------------------------------------------------------------------------


def test_one_info_record_per_optimizer_with_count_and_memory(ampguard_log):
    model = torch.nn.Linear(1024, 1024).half()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(2):
        _half_step(model, opt, torch.amp.GradScaler("cpu"))
    [record] = records(ampguard_log, logging.INFO, "master copies")
    assert record.getMessage() == (
        f"{master_weights.label(opt)} keeps float32 master copies of 2 float16 parameter tensors with 1,049,600 values (4.0 MiB)."
    )


def test_no_float16_unscale_warning_with_masters_and_one_without(ampguard_log, reinstall):
    model = torch.nn.Linear(8, 8).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _half_step(model, opt, torch.amp.GradScaler("cpu"))
    assert not records(ampguard_log, logging.WARNING)
    reinstall(AMPGUARD_MASTER_WEIGHTS="off")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _half_step(model, opt, torch.amp.GradScaler("cpu"))
    assert len(records(ampguard_log, logging.WARNING, "float16 parameters")) == 1


def test_fp16_grads_error_still_raises_torchs_value_error(reinstall):
    reinstall(AMPGUARD_FP16_GRADS="error")
    model = torch.nn.Linear(8, 8).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        _half_step(model, opt, torch.amp.GradScaler("cpu"))


def test_bad_value_is_a_config_error(reinstall):
    with pytest.raises(ampguard.ConfigError) as caught:
        reinstall(AMPGUARD_MASTER_WEIGHTS="sometimes")
    assert "AMPGUARD_MASTER_WEIGHTS" in str(caught.value) and "sometimes" in str(caught.value)
    assert "'fp16' or 'all' or 'off'" in str(caught.value)


def test_off_leaves_the_patch_unapplied(reinstall):
    statuses = {s.name: s for s in reinstall(AMPGUARD_MASTER_WEIGHTS="off")}
    assert statuses["master_weights"].state == "unavailable"
    assert "AMPGUARD_MASTER_WEIGHTS=off" in statuses["master_weights"].reason


# -- what cannot be wrapped: one message, runs as today -------------------------------


def _cannot_wrap(ampguard_log) -> list[logging.LogRecord]:
    return records(ampguard_log, logging.WARNING, "cannot keep float32 master weights")


def test_sparse_gradients_get_one_message_and_run_as_today(ampguard_log):
    embedding = torch.nn.Embedding(16, 4, sparse=True).half()
    opt = torch.optim.SGD(embedding.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(3):
        opt.zero_grad()
        scaler.scale(embedding(torch.tensor([1, 2, 3])).float().sum()).backward()
        scaler.step(opt)
        scaler.update()
    [message] = _cannot_wrap(ampguard_log)
    assert "sparse gradients" in message.getMessage()
    assert not master_weights.masters_of(opt) and embedding.weight.dtype == torch.float16
    assert torch.isfinite(embedding.weight).all() and scaler.stats.steps == 3


def test_an_optimizer_with_its_own_state_dict_gets_one_message(ampguard_log):
    model = torch.nn.Linear(8, 8).half()
    opt = OwnStateDictSGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8, dtype=torch.float16)
    before = model.weight.detach().clone()
    for _ in range(2):
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()
    [message] = _cannot_wrap(ampguard_log)
    assert "own state_dict()" in message.getMessage()
    assert not master_weights.masters_of(opt) and not torch.equal(before, model.weight)


# -- host reads -----------------------------------------------------------------------


@pytest.mark.parametrize("scaler", [True, False], ids=["grad_scaler", "plain_step"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_host_reads_per_step_with_masters_at_most_the_float32_model(optimizer, scaler, reinstall):
    reinstall(AMPGUARD_STATS_EVERY="0")
    counts = {}
    for dtype in (torch.float32, torch.float16):
        fine_tune(dtype, optimizer, 1e-4, steps=2, scaler=scaler)  # masters made, first-step work done
        with HostReadCounter() as reads:
            fine_tune(dtype, optimizer, 1e-4, steps=20, scaler=scaler)
        with HostReadCounter() as baseline:
            fine_tune(dtype, optimizer, 1e-4, steps=0, scaler=scaler)
        counts[dtype] = reads.total - baseline.total  # the held-out losses are read in both
    assert counts[torch.float16] <= counts[torch.float32]
    if scaler:
        assert counts[torch.float32] >= 20  # the scaler's one read per step is counted: the counter works here


@pytest.mark.parametrize("scaler", [True, False], ids=["grad_scaler", "plain_step"])
def test_a_failure_inside_falls_back_to_torch_with_one_warning(scaler, monkeypatch, ampguard_log):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(gradient_copies, "sync", broken)
    model = torch.nn.Linear(8, 8).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grad_scaler = torch.amp.GradScaler("cpu") if scaler else None
    before = model.weight.detach().clone()
    for _ in range(3):
        _half_step(model, opt, grad_scaler)
    [warning] = records(ampguard_log, logging.WARNING, "master weights failed")
    assert "RuntimeError: boom" in warning.getMessage()
    assert not master_weights.masters_of(opt) and not torch.equal(before, model.weight)


def test_a_second_unscale_leaves_the_master_gradients_alone():
    model = torch.nn.Linear(8, 8).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(4, 8, dtype=torch.float16)).float().square().mean()).backward()
    scaler.unscale_(opt)
    once = [g.clone() for _, g in listeners.gradients(opt)]
    scaler.unscale_(opt)  # a library and the user both call it
    assert all(torch.equal(a, b) for a, b in zip(once, (g for _, g in listeners.gradients(opt))))
    before = [m.clone() for _, m in master_weights.masters_of(opt)]
    scaler.step(opt)
    scaler.update()
    assert all(
        torch.equal(m, torch.add(b, g, alpha=-0.1))
        for (_, m), b, g in zip(master_weights.masters_of(opt), before, once)
    )


def test_zero_grad_without_set_to_none_steps_like_float32():
    """Zeroed (not None) gradients reach the masters as zeros: momentum keeps moving the weights, as in float32."""
    results = {}
    for dtype in (torch.float32, torch.float16):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8).to(torch.float16).to(dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.randn(4, 8).to(dtype)).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        opt.step()  # zero gradients: only momentum moves the weights
        results[dtype] = model.weight.detach().float()
    torch.testing.assert_close(results[torch.float16], results[torch.float32], atol=1e-3, rtol=0)
