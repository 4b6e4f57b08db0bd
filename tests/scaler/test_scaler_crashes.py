"""The classic GradScaler crashes, handled: no gradients, fp16 and bf16 parameters, a second unscale_, python -O."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import textwrap
import types
import warnings

import pytest
import torch
from scaler_support import DeviceSkipSGD, ampguard_log, iteration, one_thread, records, safe, stock  # noqa: F401

import ampguard.scaler.crashes

pytestmark = pytest.mark.usefixtures("one_thread")


def _spy_step(optimizer: torch.optim.Optimizer) -> list[int]:
    """accelerate's skip detection: optimizer.step replaced on the instance by a flag-setter."""
    calls: list[int] = []
    original = optimizer.step

    def step(self, *args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    optimizer.step = types.MethodType(step, optimizer)
    return calls


def _frozen_and_trained():
    """A model whose second optimizer holds parameters the loss never reaches."""
    model = torch.nn.Linear(4, 1)
    unused = torch.nn.Linear(4, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.01), torch.optim.SGD(unused.parameters(), lr=0.01)


# -- a. optimizer without gradients ---------------------------------------------------------


def test_torch_raises_on_an_optimizer_without_gradients(stock_torch):
    model, _, idle = _frozen_and_trained()
    scaler = stock()
    with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer"):
        iteration(scaler, model, idle)


def test_optimizer_without_gradients_is_stepped_as_in_fp32(ampguard_log):
    model, trained, idle = _frozen_and_trained()
    scaler = safe()
    idle_calls, trained_calls = _spy_step(idle), _spy_step(trained)
    schedule = torch.optim.lr_scheduler.StepLR(idle, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        for fault in (False, True, False):
            iteration(scaler, model, trained, idle, fault=fault)
            schedule.step()
    assert len(idle_calls) == 3  # every iteration, as fp32 training would
    assert len(trained_calls) == 2  # exactly the iterations that were not skipped
    assert idle.param_groups[0]["lr"] == 0.01 / 8
    stats = scaler.stats
    assert (stats.steps, stats.skipped, stats.no_grad_steps) == (6, 1, 3)
    warned = records(ampguard_log, logging.WARNING, "got no gradient")
    assert len(warned) == 1  # once per optimizer
    message = warned[0].getMessage()
    for cause in ("not connected", "frozen", "LoRA", "moved to its device", "No inf checks were recorded"):
        assert cause in message


def test_iteration_without_any_gradient_leaves_the_scale(ampguard_log):
    model = torch.nn.Linear(4, 1)
    idle = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    calls = _spy_step(idle)
    scaler = safe()
    for _ in range(3):
        iteration(scaler, model, idle)  # step and update both: no "No inf checks ... prior to update."
    assert len(calls) == 3 and scaler._scale.item() == scaler.stats.scale == 1024.0
    assert scaler.stats.no_grad_steps == 3 and scaler._counters.mirror_tracker == 0
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    iteration(scaler, model, other)
    assert len(records(ampguard_log, logging.WARNING, "got no gradient")) == 2  # one per optimizer


def test_fused_optimizer_without_gradients():
    model = torch.nn.Linear(4, 1)
    idle = DeviceSkipSGD(torch.nn.Linear(2, 2).parameters())
    calls = _spy_step(idle)
    scaler = safe()
    iteration(scaler, model, idle)
    assert len(calls) == 1 and scaler.stats.no_grad_steps == 1 and scaler.stats.skipped == 0


# -- b. fp16 parameters ---------------------------------------------------------------------


def _half_model():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).half()
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def test_torch_raises_on_fp16_parameters(stock_torch):
    model, opt = _half_model()
    with pytest.raises(ValueError, match=r"Attempting to unscale FP16 gradients\."):
        iteration(stock(), model, opt)


def test_fp16_parameters_are_unscaled_with_one_warning_and_overflows_still_skip(ampguard_log, reinstall):
    reinstall(
        AMPGUARD_MASTER_WEIGHTS="off"
    )  # the default gives them fp32 masters: tests/master_weights/test_master_weights.py
    model, opt = _half_model()
    calls = _spy_step(opt)
    scaler = safe()
    before = model.weight.detach().clone()
    iteration(scaler, model, opt)
    assert not torch.equal(before, model.weight) and torch.isfinite(model.weight).all()
    after_good = model.weight.detach().clone()
    iteration(scaler, model, opt, fault=True)
    assert torch.equal(after_good, model.weight) and len(calls) == 1
    for _ in range(3):
        iteration(scaler, model, opt)
    assert scaler.stats.skipped == 1 and len(calls) == 4
    warned = records(ampguard_log, logging.WARNING, "float16 parameters")
    assert len(warned) == 1
    assert (
        "fp32" in warned[0].getMessage().replace("float32", "fp32")
        and "AMPGUARD_FP16_GRADS=error" in warned[0].getMessage()
    )


def test_fp16_gradients_unscaled_exactly_as_torchs_kernel_would(reinstall):
    reinstall(AMPGUARD_MASTER_WEIGHTS="off")
    model, opt = _half_model()
    scaler = safe(init_scale=64.0)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.ones(2, 4)).float().sum()
    scaler.scale(loss).backward()
    scaled = model.weight.grad.clone()
    scaler.unscale_(opt)
    expected = scaled.clone()
    torch._amp_foreach_non_finite_check_and_unscale_([expected], torch.zeros(()), torch.full((), 1 / 64))
    assert model.weight.grad.dtype == torch.float16 and torch.equal(model.weight.grad, expected)


def test_fp16_grads_error_restores_torchs_value_error(reinstall):
    reinstall(AMPGUARD_FP16_GRADS="error")
    model, opt = _half_model()
    with pytest.raises(ValueError, match=r"Attempting to unscale FP16 gradients\."):
        iteration(safe(), model, opt)


# -- c. bf16 parameters ---------------------------------------------------------------------


def _bf16_run(faults: set[int], steps: int = 12):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)).to(torch.bfloat16)
    model.in_features = 4
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = safe()
    for i in range(steps):
        iteration(scaler, model, opt, fault=i in faults)
        assert all(torch.isfinite(p).all() for p in model.parameters())
    return model, scaler


def test_bf16_parameters_on_the_cpu_kernel(monkeypatch):
    kernel_dtypes = []
    kernel = torch._amp_foreach_non_finite_check_and_unscale_

    def spy(grads, found_inf, inv_scale):
        kernel_dtypes.extend(g.dtype for g in grads)
        return kernel(grads, found_inf, inv_scale)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", spy)
    _model, scaler = _bf16_run({3, 7})
    assert set(kernel_dtypes) == {torch.bfloat16}
    assert scaler.stats.skipped == 2 and scaler.stats.steps == 12


def test_bf16_parameters_without_the_kernel_mocked_cuda(monkeypatch):
    """On CUDA the kernel has no bf16 implementation (pytorch issue 127176): the kernel-less path must match it."""
    kernel_model, kernel_scaler = _bf16_run({3, 7})
    monkeypatch.setattr(ampguard.scaler.crashes, "DEVICES_WITHOUT_BF16_UNSCALE", frozenset({"cuda", "cpu"}))
    kernel = torch._amp_foreach_non_finite_check_and_unscale_

    def no_bf16_kernel(grads, found_inf, inv_scale):
        if any(g.dtype == torch.bfloat16 for g in grads):
            raise NotImplementedError("'_amp_foreach_non_finite_check_and_unscale_cuda' not implemented for 'BFloat16'")
        return kernel(grads, found_inf, inv_scale)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", no_bf16_kernel)
    mocked_model, mocked_scaler = _bf16_run({3, 7})
    assert mocked_scaler.stats.as_dict() == kernel_scaler.stats.as_dict()
    assert all(torch.equal(p, q) for p, q in zip(kernel_model.parameters(), mocked_model.parameters()))


def test_kernel_less_unscale_matches_the_kernel_on_mixed_values():
    values = torch.tensor([1.5, -3.0, 2.0**-130, 65504.0, 3.0e38, 0.0], dtype=torch.bfloat16)
    for poison in (None, float("inf"), float("-inf"), float("nan")):
        grads_a, grads_b = [values.clone(), values.clone() * -0.5], [values.clone(), values.clone() * -0.5]
        if poison is not None:
            grads_a[1][2] = grads_b[1][2] = poison
        found_a, found_b = torch.zeros(()), torch.zeros(())
        inv = torch.full((), 1 / 1024)
        torch._amp_foreach_non_finite_check_and_unscale_(grads_a, found_a, inv)
        ampguard.scaler.crashes.unscale_without_kernel_(grads_b, found_b, inv)
        assert found_a.item() == found_b.item() == (0.0 if poison is None else 1.0)
        for a, b in zip(grads_a, grads_b):
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


# -- d. unscale_ twice -------------------------------------------------------------------------


def _scaled_grads(scaler):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(2, 4)).float().sum()
    scaler.scale(loss).backward()
    return model, opt


def test_torch_raises_on_a_second_unscale(stock_torch):
    scaler = stock()
    _model, opt = _scaled_grads(scaler)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        scaler.unscale_(opt)


def test_second_unscale_is_a_noop_and_gradients_are_divided_once():
    once_scaler, twice_scaler = safe(), safe()
    once_model, once_opt = _scaled_grads(once_scaler)
    twice_model, twice_opt = _scaled_grads(twice_scaler)
    once_scaler.unscale_(once_opt)
    twice_scaler.unscale_(twice_opt)
    twice_scaler.unscale_(twice_opt)
    assert torch.equal(once_model.weight.grad, twice_model.weight.grad)
    assert twice_scaler._iteration.unscaled_optimizers == [twice_opt]
    twice_scaler.step(twice_opt)
    twice_scaler.update()
    once_scaler.step(once_opt)
    once_scaler.update()
    assert torch.equal(once_model.weight, twice_model.weight)
    with pytest.raises(RuntimeError, match="after step"):  # torch's other check stays
        iteration(twice_scaler, twice_model, twice_opt, update=False)
        twice_scaler.unscale_(twice_opt)


# -- e. python -O ----------------------------------------------------------------------------

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, warnings
    import torch


    class SGD:
        # What GradScaler needs of an optimizer (torch.optim's would import torch._dynamo: seconds).

        def __init__(self, params, lr):
            self.param_groups = [{"params": list(params), "lr": lr}]

        @torch.no_grad()
        def step(self):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.sub_(p.grad * group["lr"])


    def run():
        torch.manual_seed(0)
        out = {"optimize": sys.flags.optimize}
        model = torch.nn.Linear(4, 1)
        idle = SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
        opt = SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        for i in range(4):
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.ones(2, 4)).float().pow(2).mean()
            scaler.scale(loss).backward()
            if i == 2:
                model.weight.grad[0, 0] = float("inf")
            scaler.unscale_(opt)
            scaler.unscale_(opt)  # a second unscale_
            scaler.step(opt)
            scaler.step(idle)  # no gradients
            scaler.update()
            scaler.step(idle)  # an iteration without any gradient
            scaler.update()
        half = torch.nn.Linear(4, 1).half()  # fp16 parameters
        half_opt = SGD(half.parameters(), lr=0.1)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = half(torch.ones(2, 4)).float().sum()
        scaler.scale(loss).backward()
        scaler.step(half_opt)
        scaler.update()
        out["stats"] = scaler.stats.as_dict()
        out["weights"] = [model.weight.tolist(), half.weight.tolist()]
        return out


    if __name__ == "__main__":
        os.environ["AMPGUARD_QUIET"] = "1"
        warnings.simplefilter("ignore")
        import ampguard
        print(json.dumps(run()))
    """
)


def test_python_dash_o_behaves_the_same(tmp_path):
    script = tmp_path / "amp_crashes.py"
    script.write_text(SCRIPT)
    # Python writes no bytecode cache for -O here (PYTHONDONTWRITEBYTECODE): without one, every run
    # compiles all of torch again. A cache of its own, outside the checkout, makes later runs fast.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = os.path.join(tempfile.gettempdir(), "ampguard-tests-pycache-O")
    done = subprocess.run([sys.executable, "-O", str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    optimized = json.loads(done.stdout.strip().splitlines()[-1])
    namespace: dict = {"__name__": "amp_crashes"}
    exec(compile(SCRIPT, str(script), "exec"), namespace)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = namespace["run"]()
    assert (plain.pop("optimize"), optimized.pop("optimize")) == (int(not __debug__), 1)
    assert plain == optimized
    stats = plain["stats"]
    assert (stats["steps"], stats["skipped"], stats["no_grad_steps"]) == (13, 1, 8)


def test_fp16_grads_error_still_unscales_bf16_without_the_kernel(reinstall, monkeypatch):
    reinstall(AMPGUARD_FP16_GRADS="error")
    monkeypatch.setattr(ampguard.scaler.crashes, "DEVICES_WITHOUT_BF16_UNSCALE", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)  # must not be reached
    model = torch.nn.Linear(4, 1).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = safe()
    iteration(scaler, model, opt)
    iteration(scaler, model, opt, fault=True)
    assert (scaler.stats.steps, scaler.stats.skipped) == (2, 1)
