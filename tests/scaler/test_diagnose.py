"""Where the NaN came from: forward vs backward overflow, the parameters named, rate limits, and the cost.

The cost measurement (``test_cost_healthy_and_skipped_steps``) prints its
numbers with ``pytest tests/scaler/test_diagnose.py -k cost -s``; docs/troubleshooting.md
quotes them.
"""

from __future__ import annotations

import logging
import re
import time
from collections import OrderedDict

import pytest
import torch

import ampguard
from ampguard.scaler import diagnose
from ampguard.syncs import HostReadCounter


@pytest.fixture(autouse=True)
def _fresh_diagnose_state():
    diagnose._watched.clear()
    diagnose._states.clear()
    yield
    diagnose._watched.clear()
    diagnose._states.clear()


def make_model(layers: int = 2, width: int = 8) -> torch.nn.Sequential:
    torch.manual_seed(0)
    modules: OrderedDict[str, torch.nn.Module] = OrderedDict()
    for index in range(layers):
        modules[f"block{index}"] = torch.nn.Linear(width, width)
    return torch.nn.Sequential(modules)


def step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    *,
    poison: list[torch.nn.Parameter] = (),
    loss_inf: bool = False,
) -> None:
    """One scaled CPU step; ``poison`` gets an inf gradient entry, ``loss_inf`` makes the loss itself inf."""
    optimizer.zero_grad(set_to_none=True)
    loss = model(torch.randn(4, model[0].in_features)).square().mean()
    if loss_inf:
        loss = loss * float("inf")
    scaler.scale(loss).backward()
    with torch.no_grad():
        for param in poison:
            param.grad.view(-1)[0] = float("inf")
    scaler.step(optimizer)
    scaler.update()


def reports(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "ampguard" and re.match(r"step \d+ skipped", r.getMessage())]


def test_watch_is_public_and_returns_the_model():
    model = make_model()
    assert ampguard.watch(model) is model
    assert "watch" in ampguard.__all__
    with pytest.raises(TypeError):
        ampguard.watch(object())  # type: ignore[arg-type]


def test_backward_overflow_names_the_watched_parameter(caplog):
    model = ampguard.watch(make_model(3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampguard.SafeGradScaler("cpu")
    with caplog.at_level(logging.INFO, logger="ampguard"):
        step(model, optimizer, scaler, poison=[model.block1.weight])
    [record] = reports(caplog)
    message = record.getMessage()
    assert record.levelno == logging.INFO
    assert "step 1 skipped at loss scale 1024: backward overflow" in message
    assert "inf/NaN gradients in 1 of the 6 parameters of SGD" in message and "block1.weight." in message
    assert "ampguard.watch" not in message  # names were known


def test_forward_overflow_is_a_warning(caplog):
    model = ampguard.watch(make_model(), prefix="net.")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampguard.SafeGradScaler("cpu")
    with caplog.at_level(logging.INFO, logger="ampguard"):
        step(model, optimizer, scaler, loss_inf=True)
    [record] = reports(caplog)
    message = record.getMessage()
    assert record.levelno == logging.WARNING
    assert "forward overflow: the loss itself was inf/NaN" in message
    assert "no loss scale can help" in message
    # The gradients all came from that loss: how many are inf/NaN, not a list of names that says nothing.
    assert "Its backward pass made the gradients of" in message and "do not show where the overflow began" in message
    assert "net.block0.weight" not in message and "ampguard.watch" not in message
    assert scaler.stats.nonfinite_loss == 1


def test_first_few_names_and_the_total(caplog):
    model = ampguard.watch(make_model(6))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampguard.SafeGradScaler("cpu")
    poisoned = [
        model.block0.weight,
        model.block1.bias,
        model.block2.weight,
        model.block3.weight,
        model.block4.bias,
        model.block5.weight,
        model.block5.bias,
    ]
    with caplog.at_level(logging.INFO, logger="ampguard"):
        step(model, optimizer, scaler, poison=poisoned)
    message = reports(caplog)[0].getMessage()
    assert "in 7 of the 12 parameters" in message
    assert "block0.weight, block1.bias, block2.weight, block3.weight, block4.bias and 2 more." in message


def test_names_from_the_optimizer_when_it_knows_them(caplog):
    model = make_model()
    try:
        optimizer = torch.optim.SGD(model.named_parameters(), lr=0.1)
    except TypeError:
        pytest.skip("this torch's optimizers take no named parameters")
    scaler = ampguard.SafeGradScaler("cpu")
    with caplog.at_level(logging.INFO, logger="ampguard"):
        step(model, optimizer, scaler, poison=[model.block1.bias])
    message = reports(caplog)[0].getMessage()
    assert "block1.bias." in message and "ampguard.watch" not in message


def test_without_names_positions_and_a_hint(caplog):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampguard.SafeGradScaler("cpu")
    with caplog.at_level(logging.INFO, logger="ampguard"):
        step(model, optimizer, scaler, poison=[model.block1.weight])
    message = reports(caplog)[0].getMessage()
    assert "param_groups[0][2] (8x8 float32)" in message
    assert "ampguard.watch(model) names them" in message


def test_nan_everywhere_after_clipping_is_explained(caplog):
    model = ampguard.watch(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampguard.SafeGradScaler("cpu")
    optimizer.zero_grad()
    scaler.scale(model(torch.randn(4, 8)).square().mean()).backward()
    with torch.no_grad():
        for param in model.parameters():
            param.grad.fill_(float("nan"))  # what a clip with a NaN total norm leaves
    with caplog.at_level(logging.INFO, logger="ampguard"):
        scaler.step(optimizer)
        scaler.update()
    assert "Every gradient is non-finite" in reports(caplog)[0].getMessage()


def test_first_occurrence_then_once_per_stats_interval(reinstall, caplog):
    reinstall(AMPGUARD_STATS_EVERY="10")
    model = ampguard.watch(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampguard.SafeGradScaler("cpu", min_scale=0)
    with caplog.at_level(logging.INFO, logger="ampguard"):
        for number in range(1, 26):
            overflow = number in (1, 2, 3, 7, 12, 13, 25)
            step(model, optimizer, scaler, poison=[model.block0.bias] if overflow else [])
    described = [r.getMessage() for r in reports(caplog)]
    assert [m.split(" skipped")[0] for m in described] == ["step 1", "step 12", "step 25"]
    assert "(3 skipped steps since the previous report were not described.)" in described[1]
    assert "(1 skipped step since the previous report was not described.)" in described[2]
    assert (
        "(Further skipped steps up to step 10 are counted in the stats line but not described; "
        "the first one from step 11 on is described again.)" in described[0]
    )
    assert scaler.stats.skipped == 7


def test_stats_every_zero_reports_only_the_first(reinstall, caplog):
    reinstall(AMPGUARD_STATS_EVERY="0")
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampguard.SafeGradScaler("cpu", min_scale=0)
    with caplog.at_level(logging.INFO, logger="ampguard"):
        for _ in range(5):
            step(model, optimizer, scaler, poison=[model.block0.bias])
    assert len(reports(caplog)) == 1


def test_two_optimizers_of_one_step_are_both_described(caplog):
    generator, critic = ampguard.watch(make_model(), prefix="G."), ampguard.watch(make_model(), prefix="D.")
    optimizers = [torch.optim.SGD(generator.parameters(), lr=0.1), torch.optim.SGD(critic.parameters(), lr=0.1)]
    scaler = ampguard.SafeGradScaler("cpu")
    loss = generator(torch.randn(2, 8)).sum() + critic(torch.randn(2, 8)).sum()
    scaler.scale(loss).backward()
    with torch.no_grad():
        generator.block0.weight.grad[0, 0] = float("inf")
        critic.block1.bias.grad[0] = float("nan")
    with caplog.at_level(logging.INFO, logger="ampguard"):
        for optimizer in optimizers:
            scaler.step(optimizer)
        scaler.update()
    described = [r.getMessage() for r in reports(caplog)]
    assert len(described) == 2
    assert "G.block0.weight" in described[0] and "D.block1.bias" in described[1]


def test_a_failing_diagnosis_never_breaks_the_step(monkeypatch):
    def broken(optimizer):
        raise RuntimeError("boom")

    monkeypatch.setattr(diagnose, "nonfinite_parameters", broken)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampguard.SafeGradScaler("cpu")
    step(model, optimizer, scaler, poison=[model.block0.bias])
    assert scaler.stats.skipped == 1


def test_healthy_steps_do_no_work(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(diagnose, "on_skipped_step", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(diagnose, "nonfinite_parameters", lambda *a: calls.append(a))
    model = ampguard.watch(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampguard.SafeGradScaler("cpu")
    with HostReadCounter() as reads, caplog.at_level(logging.DEBUG, logger="ampguard"):
        for _ in range(20):
            step(model, optimizer, scaler)
    assert calls == []
    assert scaler.stats.skipped == 0
    assert reads.by_source["ampguard.read_to_host"] == 0
    assert reads.total == 20  # torch's own read in step(), nothing else
    assert reports(caplog) == []


def _reads_of_one_skipped_step(model, optimizer, scaler) -> HostReadCounter:
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(model(torch.randn(4, 64)).square().mean()).backward()
    model.block3.bias.grad[0] = float("inf")
    with HostReadCounter() as reads:
        scaler.step(optimizer)
    scaler.update()
    return reads


def test_cost_healthy_and_skipped_steps(reinstall, capsys):
    """Healthy step: zero work (no call, no read). Skipped step: one read when described, none otherwise."""
    reinstall(AMPGUARD_STATS_EVERY="1000")
    model = ampguard.watch(make_model(layers=50, width=64))  # 100 parameter tensors
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampguard.SafeGradScaler("cpu", min_scale=0)
    logging.getLogger("ampguard").disabled = True
    try:
        described = _reads_of_one_skipped_step(model, optimizer, scaler)
        quiet = _reads_of_one_skipped_step(model, optimizer, scaler)
    finally:
        logging.getLogger("ampguard").disabled = False
    assert described.by_source == {"aten::_local_scalar_dense": 1, "ampguard.read_to_host": 1}
    assert quiet.by_source == {"aten::_local_scalar_dense": 1, "ampguard.read_to_host": 0}

    # CPU time of the diagnosis itself (not wall time: the machine may be shared), gradients of a skipped step in place.
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(model(torch.randn(4, 64)).square().mean()).backward()
    model.block3.bias.grad[0] = float("inf")
    timings = []
    for _ in range(50):
        start = time.process_time()
        found = diagnose.nonfinite_parameters(optimizer)
        timings.append(time.process_time() - start)
    assert found.total == 1 and found.names == ["block3.bias"]
    # A skipped step inside an interval already described: the whole call, as the scaler makes it.
    suppressed = []
    for number in range(3, 1000):
        start = time.perf_counter()
        diagnose.on_skipped_step(scaler, optimizer, loss_nonfinite=False, step=number)
        suppressed.append(time.perf_counter() - start)
    assert diagnose._states[scaler].unreported == 1 + len(suppressed)
    with capsys.disabled():
        print(
            f"\n[diagnose cost, torch {torch.__version__}] healthy step: 0 calls, 0 host reads; "
            f"skipped step, described: 1 host read, {sorted(timings)[len(timings) // 2] * 1e3:.2f} ms "
            f"(100 parameter tensors, {sum(p.numel() for p in model.parameters())} values, CPU); "
            f"skipped step, not described: 0 host reads, {sorted(suppressed)[len(suppressed) // 2] * 1e6:.2f} us"
        )
