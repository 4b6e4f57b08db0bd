"""ampguard never silently differs from torch: each loop runs under plain torch in another process.

Where torch trains, ampguard must give torch's numbers. Where torch refuses
(raises), ampguard either raises torch's error or, where the loop has one
right answer, gives the numbers of the recipe that gets it right in torch
(unscale once, or the same loop in float32). The scenarios are in
tests/support/parity_scenarios.py, which imports only torch.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import pickle
import subprocess
import sys
import threading
import types
from pathlib import Path

import parity_scenarios as scenarios
import pytest
import torch
from scaler_support import needs_fused_adam

import ampguard
import ampguard.scaler

SCENARIO_FILE = Path(scenarios.__file__)


@pytest.fixture(autouse=True)
def _no_scaler_left_in_play():
    """A scaler that scaled and was never updated stays "in play" until collected: none from another test."""
    ampguard.scaler.scalers_in_iteration.clear()
    yield
    ampguard.scaler.scalers_in_iteration.clear()


@functools.cache
def _plain_torch_outcomes() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPGUARD")}
    done = subprocess.run(
        [sys.executable, str(SCENARIO_FILE)], capture_output=True, text=True, timeout=600, env=env, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def plain_torch(name: str) -> dict:
    """The scenario's outcome in a fresh process that never imports ampguard (all scenarios run once)."""
    outcome = dict(_plain_torch_outcomes()[name])
    assert outcome.pop("ampguard_loaded") is False
    return outcome


def under_ampguard(name: str) -> dict:
    outcome = scenarios.outcome(name)
    assert outcome.pop("ampguard_loaded") is True
    return outcome


def test_reference_process_runs_without_ampguard():
    assert "error" not in plain_torch("accumulate_unscale_once")


# -- unscale_ on every micro-step ------------------------------------------------------------


@pytest.mark.parametrize("overflow", [False, True], ids=["healthy", "later_micro_step_overflows"])
def test_unscale_every_micro_step_equals_unscaling_once(overflow):
    suffix = "_later_overflow" if overflow else ""
    refused = plain_torch("accumulate_unscale_each_micro_step" + suffix)
    assert refused["error"] == "RuntimeError" and "unscale_() has already been called" in refused["message"]
    reference = plain_torch("accumulate_unscale_once" + suffix)["result"]
    assert under_ampguard("accumulate_unscale_each_micro_step" + suffix)["result"] == reference
    if overflow:  # the overflowed iteration was skipped and the scale backed off once
        assert reference["scale"] == 512.0


def test_clip_on_every_micro_step_equals_float32(caplog):
    """accelerate's clip_grad_norm_ on every micro-step: torch refuses; ampguard clips what fp32 clips."""
    refused = plain_torch("accumulate_clip_each_micro_step")
    assert refused["error"] == "RuntimeError" and "unscale_() has already been called" in refused["message"]
    reference = plain_torch("accumulate_clip_each_micro_step_fp32")["result"]
    result = under_ampguard("accumulate_clip_each_micro_step")["result"]
    assert result["scale"] == 1024.0  # nothing overflowed, nothing skipped
    torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(reference["norms"]), rtol=1e-6, atol=0)
    for got, want in zip(result["params"], reference["params"]):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-6, atol=1e-7)


def test_second_unscale_without_new_gradients_stays_a_no_op():
    model = scenarios._model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = scenarios._scaler()
    ((x, y),) = scenarios._batches(1)
    scaler.scale(scenarios._loss(model, x, y)).backward()
    scaler.unscale_(opt)
    once = [p.grad.clone() for p in model.parameters()]
    scaler.unscale_(opt)  # a library unscales again: torch raises, ampguard divides once
    assert all(torch.equal(a, p.grad) for a, p in zip(once, model.parameters()))


# -- the closure, the list loss ---------------------------------------------------------------


def test_positional_closure_without_gradients_raises_torchs_error():
    refused = plain_torch("step_with_positional_closure")
    assert refused == {"error": "AssertionError", "message": "No inf checks were recorded for this optimizer."}
    outcome = under_ampguard("step_with_positional_closure")
    assert outcome["error"] == "AssertionError"
    assert outcome["message"].startswith("No inf checks were recorded for this optimizer.")
    assert "closure" in outcome["message"]


def test_nan_loss_inside_a_list_is_counted_and_reported(caplog):
    reference = plain_torch("nan_loss_in_a_list")["result"]
    with caplog.at_level(logging.INFO, logger="ampguard"):
        result = under_ampguard("nan_loss_in_a_list")["result"]
    # The same parameters (the step was skipped); the scale is not lowered for a forward overflow
    # (docs/islands.md), where torch halves it.
    assert result["params"] == reference["params"]
    assert (reference["scale"], result["scale"]) == (512.0, 1024.0)
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1 and "forward overflow" in skipped[0] and "the loss itself was inf/NaN" in skipped[0]


def test_loss_check_covers_nested_lists_and_tuples():
    scaler = torch.amp.GradScaler("cpu")
    w = torch.ones(2, requires_grad=True)
    scaled = scaler.scale((w.sum(), [w.sum() * 2, (w * float("inf")).sum()]))
    assert isinstance(scaled, tuple) and isinstance(scaled[1], list)
    assert torch.isnan(scaler._iteration.loss_check)


# -- clipping with a threshold for scaled gradients -----------------------------------------------


@pytest.mark.parametrize(
    "name", ["clip_scaled_threshold_sgd", pytest.param("clip_scaled_threshold_fused_adam", marks=needs_fused_adam)]
)
def test_clip_with_a_scaled_threshold_is_torchs(name):
    reference = plain_torch(name)["result"]
    assert under_ampguard(name)["result"] == reference  # bit for bit, returned norms included


def test_clip_threshold_is_unscaled_when_get_scale_was_not_read():
    """The documented improvement stays: unscale_ forgotten, max_norm applies to the unscaled gradients."""
    model = scenarios._model()
    scaler = scenarios._scaler()
    ((x, y),) = scenarios._batches(1)
    scaler.scale(scenarios._loss(model, x, y) * 100).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    unscaled = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])) / 1024
    assert norm > 0.5
    torch.testing.assert_close(unscaled, torch.tensor(0.5), rtol=1e-5, atol=0)


# -- crashes plain torch does not have -------------------------------------------------------------


def test_fsdp_sharded_scaler_pickles_and_loads_in_a_new_process(tmp_path):
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    scaler = ShardedGradScaler("cpu", init_scale=256.0)
    assert isinstance(scaler, ampguard.SafeGradScaler)
    path = tmp_path / "scaler.pt"
    torch.save(scaler, path)
    assert type(pickle.loads(pickle.dumps(scaler))) is type(scaler)
    code = (
        "import ampguard, torch, sys\n"
        f"s = torch.load({str(path)!r}, weights_only=False)\n"
        "from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler\n"
        "print(type(s) is ShardedGradScaler, isinstance(s, ampguard.SafeGradScaler), s.get_scale())\n"
    )
    env = {**os.environ, "AMPGUARD_QUIET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, check=True
    )
    assert done.stdout.split() == ["True", "True", "256.0"]


def test_fsdp_sharded_scaler_patched_once_when_its_import_hook_comes_late(monkeypatch, caplog):
    """FSDP's scaler module imported by another thread while install ran: install patched it from sys.modules, and
    the import hook, run once install let go of its lock, leaves it as it is (no second subclass, no warning)."""
    import torch.distributed.fsdp.sharded_grad_scaler as sharded_module

    import ampguard.patches.grad_scaler as grad_scaler_patch
    import ampguard.registry as registry

    patched = sharded_module.ShardedGradScaler
    assert issubclass(patched, ampguard.SafeGradScaler)
    monkeypatch.setattr(logging.getLogger("ampguard"), "propagate", True)
    with caplog.at_level(logging.WARNING, logger="ampguard"):
        registry._imported("grad_scaler", grad_scaler_patch._patch_sharded, sharded_module)  # the late hook
    assert sharded_module.ShardedGradScaler is patched
    assert isinstance(sharded_module.ShardedGradScaler("cpu"), ampguard.SafeGradScaler)
    assert not [r.getMessage() for r in caplog.records if r.name == "ampguard"]


def _train_in_thread(seed: int, steps: int = 200) -> list[torch.Tensor]:
    # The initial weights from this thread's own generator: torch.manual_seed is process-wide, and
    # another thread reseeding between it and the layer's initialisation gave other weights.
    generator = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.rand(parameter.shape, generator=generator) - 0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(steps):
        opt.zero_grad()
        scaler.scale(model(torch.ones(2, 4)).sum() * (seed + 1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # before unscale_: reads the scalers in play
        scaler.step(opt)
        scaler.update()
    return [p.detach().clone() for p in model.parameters()]


def test_threads_clipping_at_once_each_with_its_own_scaler(caplog):
    """The set of scalers in play is process-wide: threads change it while others clip."""
    alone = {seed: _train_in_thread(seed) for seed in range(3)}
    together: dict[int, list[torch.Tensor]] = {}
    errors: list[BaseException] = []

    def run(seed: int) -> None:
        try:
            together[seed] = _train_in_thread(seed)
        except BaseException as error:  # reported by the assertion below
            errors.append(error)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    threads = [threading.Thread(target=run, args=(seed,)) for seed in alone]
    try:
        with caplog.at_level(logging.WARNING, logger="ampguard"):
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    finally:
        sys.setswitchinterval(switch)
    assert errors == []
    assert not [r for r in caplog.records if "GradScalers scaled a loss" in r.getMessage()]
    for seed, params in alone.items():  # each thread clipped with its own scale, as when alone
        assert all(torch.equal(a, b) for a, b in zip(params, together[seed]))


def test_uninstall_keeps_a_users_own_safe_scaler(stock_torch):
    ampguard.install()
    module = types.ModuleType("user_code_with_its_own_scaler")
    module.GradScaler = ampguard.SafeGradScaler  # the user's choice, by name
    module.make_scaler = functools.partial(ampguard.SafeGradScaler, "cpu", min_scale=4.0)
    module.torch_spelling = functools.partial(torch.amp.GradScaler, "cpu")  # ampguard's stand-in: restored
    sys.modules[module.__name__] = module
    try:
        ampguard.uninstall()
        assert module.GradScaler is ampguard.SafeGradScaler
        assert module.make_scaler.func is ampguard.SafeGradScaler
        assert module.make_scaler().stats.scale == 1024.0
        assert module.torch_spelling.func is torch.amp.GradScaler is ampguard.scaler.TorchGradScaler
    finally:
        del sys.modules[module.__name__]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"min_scale": 8.0, "max_scale": 4.0}, "min_scale=8, max_scale=4"),
        ({"max_scale": 1e39}, "float32"),
        ({"min_scale": -1.0}, "min_scale=-1"),
    ],
)
def test_scale_bounds_out_of_float32_or_crossed_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        ampguard.SafeGradScaler("cpu", **options)


def test_max_scale_beyond_float32_is_a_config_error_at_import():
    env = {**os.environ, "AMPGUARD_MAX_SCALE": "1e39"}
    done = subprocess.run([sys.executable, "-c", "import ampguard"], capture_output=True, text=True, env=env)
    assert done.returncode == 1
    assert "ConfigError: AMPGUARD_MAX_SCALE='1e39' is not valid" in done.stderr


def test_unscale_every_micro_step_with_float16_master_weights():
    """The unscaled gradient then lives in the float32 master: re-scaling writes it back into ``p.grad``."""

    def run(unscale_every_micro_step: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 3).half()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = scenarios._scaler()
        batches = iter(scenarios._batches(scenarios.ITERATIONS * scenarios.MICRO_STEPS))
        for _ in range(scenarios.ITERATIONS):
            opt.zero_grad()
            for micro in range(scenarios.MICRO_STEPS):
                x, y = next(batches)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = torch.nn.functional.mse_loss(model(x.half()).float(), y) / scenarios.MICRO_STEPS
                scaler.scale(loss).backward()
                if unscale_every_micro_step or micro == scenarios.MICRO_STEPS - 1:
                    scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        assert model.weight.dtype == torch.float16
        return model.weight.detach().clone()

    torch.manual_seed(0)
    start = torch.nn.Linear(6, 3).half().weight.detach().clone()  # what run() starts from
    once = run(False)
    assert not torch.equal(once, start)
    assert torch.equal(run(True), once)


def _non_finite_loss_run(scaler_class: type, mode: str, loss: str, gradients: str, interval: int) -> list:
    """Three iterations, the second with an inf/NaN loss; (scale, growth tracker, parameters) after each update.

    ``mode``: "host" (SGD, the host reads the verdict), "fused" (AdamW(fused=True): device mode) or
    "new_scale" (SGD after ``update(new_scale)``: device mode, the ledger's path).
    """
    param = torch.nn.Parameter(torch.ones(3))
    if mode == "fused":
        optimizer: torch.optim.Optimizer = torch.optim.AdamW([param], lr=0.1, fused=True)
    else:
        optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = scaler_class("cpu", init_scale=8.0, growth_interval=interval)
    history = []
    for iteration in range(3):
        optimizer.zero_grad()
        if iteration != 1:
            scaled = (param * 2.0).sum()
        elif gradients == "finite":  # a non-finite constant in the loss: its gradients stay finite
            scaled = param.sum() + torch.tensor(float(loss))
        else:
            scaled = (param * float(loss)).sum()
        scaler.scale(scaled).backward()
        scaler.step(optimizer)
        forward_overflow = iteration == 1 and gradients == "nonfinite"
        kept = (scaler._scale.clone(), scaler._growth_tracker.clone())
        scaler.update(16.0 if mode == "new_scale" and iteration == 0 else None)
        if forward_overflow and scaler_class is ampguard.scaler.TorchGradScaler:
            scaler._scale.copy_(kept[0])  # the documented difference, applied to torch's run
            scaler._growth_tracker.copy_(kept[1])
        history.append((scaler.get_scale(), scaler._get_growth_tracker(), param.detach().tolist()))
    return history


@pytest.mark.parametrize("interval", [1, 3])
@pytest.mark.parametrize("gradients", ["finite", "nonfinite"])
@pytest.mark.parametrize("loss", ["inf", "nan"])
@pytest.mark.parametrize("mode", ["host", "new_scale", pytest.param("fused", marks=needs_fused_adam)])
def test_a_non_finite_loss_keeps_the_scale_with_growth_interval_one(mode, loss, gradients, interval):
    """docs/torch-parity.md: an iteration whose gradients overflowed because the loss itself was inf/NaN is
    skipped and keeps the scale and the growth tracker (torch halves the scale); a non-finite loss with finite
    gradients steps and counts as in torch. Host mode and device mode (fused, update(new_scale)) alike.

    Found by tests/parity/test_differential.py: with growth_interval=1 the skipped step grew the scale (8 -> 16; torch
    8 -> 4, the documented difference says 8); in device mode a non-finite loss with finite gradients held the
    growth tracker where torch counts the step.
    """
    reference = _non_finite_loss_run(ampguard.scaler.TorchGradScaler, mode, loss, gradients, interval)
    result = _non_finite_loss_run(torch.amp.GradScaler, mode, loss, gradients, interval)
    assert result == reference
    if gradients == "nonfinite":  # the skipped iteration left the scale where it was
        assert result[1][0] == result[0][0] and result[1][2] == result[0][2]
