"""The GradScaler behaviours PyTorch's own AMP tests exercise, each checked against torch's own scaler.

Every test runs the same code twice: once with torch as it is without ampguard
(ampguard uninstalled for that run, or torch's class ``TorchGradScaler``), once
under ampguard's defaults, where ``torch.amp.GradScaler("cpu", ...)`` is a
SafeGradScaler. The scalers get explicit ``init_scale`` and ``growth_interval``,
so ampguard's own defaults (1024 and 100) do not enter. Where the arithmetic is
the same the results must be bit-identical; where ampguard differs on purpose
(the scale cap, no back-off for a non-finite loss, float16 gradients accepted)
the test says so and asserts the documented difference.

The map from upstream tests to these is in docs/torch-parity.md; scaled-threshold
clipping, accumulation with ``unscale_`` per micro-step, the positional closure
and the list loss are in tests/parity/test_torch_parity.py.
"""

from __future__ import annotations

import copy
import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from scaler_support import DeviceSkipSGD, plain_torch
from torch.amp.grad_scaler import _refresh_per_optimizer_state

import ampguard
import ampguard.scaler
from ampguard.config import FLOAT32_MAX
from ampguard.scaler import SafeGradScaler

SKIP_AT = 2  # the iteration whose gradients get an inf written into them: a skipped step
ITERATIONS = 5
CAP = 2.0**24  # AMPGUARD_MAX_SCALE's default


# -- running the same code under plain torch and under ampguard ------------------------------------


@dataclass
class Outcome:
    scaler: Any
    tensors: list[torch.Tensor]  # parameters, gradients and optimizer state at the end, in a fixed order
    scales: list[float]  # get_scale() after every update()


def torch_then_ampguard(loop: Callable[[], Outcome]) -> tuple[Outcome, Outcome]:
    with plain_torch():
        reference = loop()
    result = loop()
    assert type(reference.scaler) is ampguard.scaler.TorchGradScaler
    assert isinstance(result.scaler, SafeGradScaler)
    return reference, result


def assert_same(result: Outcome, reference: Outcome, *, exact: bool = True) -> None:
    """The same scales, and the same tensors (bit for bit with ``exact``; NaN where torch has NaN)."""
    assert result.scales == reference.scales
    assert len(result.tensors) == len(reference.tensors)
    tolerance = {"rtol": 0.0, "atol": 0.0} if exact else {}
    for got, want in zip(result.tensors, reference.tensors):
        torch.testing.assert_close(got, want, equal_nan=True, **tolerance)


def snapshot(*models: torch.nn.Module, optimizers: tuple[torch.optim.Optimizer, ...] = ()) -> list[torch.Tensor]:
    tensors = []
    for model in models:
        for p in model.parameters():
            tensors.append(p.detach().clone())
            if p.grad is not None:
                tensors.append(p.grad.detach().clone())
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                for _key, value in sorted(opt.state[p].items()):
                    if isinstance(value, torch.Tensor):
                        tensors.append(value.detach().clone().reshape(-1).float())
    return tensors


def scaler(init_scale: float = 128.0, growth_interval: int = 1, **options: Any) -> Any:
    """``torch.amp.GradScaler("cpu", ...)`` as the code under test writes it: whatever the name is now."""
    return torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval, **options)


def model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


def batches(count: int = ITERATIONS, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = torch.Generator().manual_seed(seed)
    return [(torch.randn(5, 6, generator=data), torch.randn(5, 4, generator=data)) for _ in range(count)]


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out.float(), target)


def poison(net: torch.nn.Sequential) -> None:
    with torch.no_grad():
        net[2].weight.grad.fill_(float("inf"))


def expected_scale(init: float, grown: int, backed_off: int) -> float:
    return init * 2.0**grown * 0.5**backed_off


# -- optimizers ------------------------------------------------------------------------------------


def _fused_available(cls: type[torch.optim.Optimizer]) -> bool:
    """Construct and step: torch 2.3 builds SGD(fused=True) on CPU, then has no kernel at step()."""
    param = torch.nn.Parameter(torch.zeros(1))
    param.grad = torch.ones(1)
    try:
        cls([param], lr=0.1, fused=True).step()
    except (RuntimeError, ValueError, TypeError, NotImplementedError):
        return False
    return True


def _optimizer_param(name: str, cls: type[torch.optim.Optimizer], **kwargs: Any) -> Any:
    marks = []
    if kwargs.get("fused") and not _fused_available(cls):
        marks.append(pytest.mark.skip(reason=f"{cls.__name__}(fused=True) has no CPU kernel before torch 2.4"))
    return pytest.param(cls, kwargs, id=name, marks=marks)


OPTIMIZERS = [
    _optimizer_param("sgd", torch.optim.SGD, lr=0.1, momentum=0.9),
    _optimizer_param("sgd_foreach", torch.optim.SGD, lr=0.1, momentum=0.9, foreach=True),
    _optimizer_param("sgd_fused", torch.optim.SGD, lr=0.1, momentum=0.9, fused=True),
    _optimizer_param("adam", torch.optim.Adam, lr=0.01),
    _optimizer_param("adam_foreach", torch.optim.Adam, lr=0.01, foreach=True),
    _optimizer_param("adam_fused", torch.optim.Adam, lr=0.01, fused=True),
    _optimizer_param("adamw", torch.optim.AdamW, lr=0.01),
    _optimizer_param("adamw_fused", torch.optim.AdamW, lr=0.01, fused=True),
]


# -- state_dict and pickle -------------------------------------------------------------------------


def _getters(s: Any) -> tuple[float, float, float, int, int]:
    return (
        s.get_scale(),
        s.get_growth_factor(),
        s.get_backoff_factor(),
        s.get_growth_interval(),
        s._get_growth_tracker(),
    )


TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


@pytest.mark.parametrize("target_scale_created", [False, True], ids=["lazy_target", "created_target"])
def test_state_dict_of_a_never_used_scaler_loads_as_in_torch(target_scale_created):
    def load() -> tuple[Any, dict[str, Any]]:
        source = scaler(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
        target = scaler(init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
        if target_scale_created:
            target.scale(torch.tensor(4.0))
            assert target._scale is not None
        state = source.state_dict()
        assert source._scale is None  # state_dict() does not create the scale tensor
        target.load_state_dict(state)
        return target, state

    with plain_torch():
        torch_target, torch_state = load()
    target, state = load()
    assert {k: state[k] for k in TORCH_KEYS} == torch_state
    assert _getters(target) == _getters(torch_target) == (3.0, 4.0, 0.5, 2, 0)
    if target_scale_created:  # the loaded scale is in the tensor that scale() multiplies by
        assert target.scale(torch.tensor(2.0)).item() == torch_target.scale(torch.tensor(2.0)).item() == 6.0


def _train(
    s: Any,
    net: torch.nn.Sequential,
    opt: torch.optim.Optimizer,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    skip_at: int | None = SKIP_AT,
    after_update: Callable[[Any], Any] = lambda s: s,
) -> tuple[Any, list[float]]:
    """fp16-autocast iterations, an inf gradient at ``skip_at``; ``after_update`` may replace the scaler."""
    scales = []
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = net(x)
        s.scale(mse(out, y)).backward()
        if i == skip_at:
            poison(net)
        s.step(opt)
        s.update()
        s = after_update(s)
        scales.append(s.get_scale())
    return s, scales


def test_torch_state_loads_into_ampguard_and_back():
    """torch's checkpoint resumed by SafeGradScaler, and SafeGradScaler's by torch's class: both continue as torch."""
    TorchGradScaler = ampguard.scaler.TorchGradScaler
    stock = TorchGradScaler("cpu", init_scale=64.0, growth_interval=2, growth_factor=4.0, backoff_factor=0.25)
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    _train(stock, net, opt, batches(3, seed=5), skip_at=1)
    saved = stock.state_dict()
    assert saved["_growth_tracker"] == 1  # a growth interval half done travels too

    safe = scaler(init_scale=1.0, growth_interval=7)
    safe.load_state_dict(saved)
    assert _getters(safe) == _getters(stock)
    assert {k: safe.state_dict()[k] for k in TORCH_KEYS} == saved

    back = TorchGradScaler("cpu")
    back.load_state_dict(safe.state_dict())  # ampguard's extra "ampguard" entry is ignored by torch
    assert _getters(back) == _getters(stock)

    net_a, net_b, net_c = copy.deepcopy(net), copy.deepcopy(net), copy.deepcopy(net)
    data = batches(6, seed=6)
    scales = {
        name: _train(s, n, torch.optim.SGD(n.parameters(), lr=0.1), data, skip_at=3)[1]
        for name, s, n in (("stock", stock, net_a), ("safe", safe, net_b), ("back", back, net_c))
    }
    assert scales["safe"] == scales["back"] == scales["stock"]
    for net_x in (net_b, net_c):
        assert all(torch.equal(p, q) for p, q in zip(net_x.parameters(), net_a.parameters(), strict=True))


@pytest.mark.parametrize("scale_created", [False, True], ids=["before_lazy_scale", "after_scale_call"])
def test_pickle_round_trip_as_torch(scale_created):
    def round_trip() -> tuple[Any, Any]:
        s = scaler(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
        if scale_created:
            s.scale(torch.tensor(4.0))
        return s, pickle.loads(pickle.dumps(s))

    with plain_torch():
        _torch_original, torch_copy = round_trip()
    original, restored = round_trip()
    assert type(restored) is type(original)
    assert restored.is_enabled() and torch_copy.is_enabled()
    assert _getters(restored) == _getters(torch_copy) == (3.0, 4.0, 0.5, 2, 0)
    assert restored._scale is None and torch_copy._scale is None  # both re-create the tensor lazily
    # a fresh per-optimizer state for an optimizer never seen (the defaultdict survives pickling)
    assert restored._per_optimizer_states["never seen"] == _refresh_per_optimizer_state()
    assert restored.scale(torch.tensor(4.0)).item() == torch_copy.scale(torch.tensor(4.0)).item() == 12.0


def test_pickle_after_some_iterations_continues_as_torch():
    def loop() -> Outcome:
        net = model()
        opt = torch.optim.Adam(net.parameters(), lr=0.01)
        s = scaler(init_scale=256.0, growth_interval=3)
        _, scales = _train(s, net, opt, batches(4, seed=2), skip_at=1)
        restored = pickle.loads(pickle.dumps(s))
        assert _getters(restored) == _getters(s)
        scales += _train(restored, net, opt, batches(5, seed=3))[1]
        return Outcome(restored, snapshot(net, optimizers=(opt,)), scales)

    reference, result = torch_then_ampguard(loop)
    assert_same(result, reference)
    # halved at both skips, grown after 3 good steps: the pickled copy carried a growth tracker of 2
    assert reference.scales == [256.0, 128.0, 128.0, 128.0, 256.0, 256.0, 128.0, 128.0, 128.0]


@pytest.mark.parametrize("opt_class, options", OPTIMIZERS)
def test_replacing_the_scaler_by_an_unpickled_copy_after_every_update(opt_class, options):
    """Autocast fp16, a skipped step, and the scaler pickled and replaced after each update(): torch's numbers."""

    def loop() -> Outcome:
        net = model()
        opt = opt_class(net.parameters(), **options)
        s, scales = _train(scaler(), net, opt, batches(), after_update=lambda s: pickle.loads(pickle.dumps(s)))
        return Outcome(s, snapshot(net, optimizers=(opt,)), scales)

    reference, result = torch_then_ampguard(loop)
    assert_same(result, reference)
    assert reference.scales[-1] == expected_scale(128.0, grown=ITERATIONS - 1, backed_off=1)


# -- unscale_ ---------------------------------------------------------------------------------------


def _grid(value: float = 4.0, dtype: torch.dtype = torch.float32, bad: float | None = None) -> torch.Tensor:
    g = torch.full((12, 12), value, dtype=dtype)
    if bad is not None:
        g[3, 3] = bad
    return g


INF, NAN = float("inf"), float("nan")
# (first gradient, second gradient) as views: contiguous, transposed (dense but not contiguous),
# and column slices (neither): the unscale kernel takes a different path for the last kind.
LAYOUTS = {
    "contiguous": (lambda: _grid(), lambda: _grid(), False),
    "transposed": (lambda: _grid(), lambda: _grid().t(), False),
    "one_sliced": (lambda: _grid(), lambda: _grid()[:, :4], False),
    "both_sliced": (lambda: _grid()[:, :4], lambda: _grid()[:, :4], False),
    "inf": (lambda: _grid(), lambda: _grid(bad=INF), True),
    "nan": (lambda: _grid(), lambda: _grid(bad=NAN), True),
    "inf_in_slice": (lambda: _grid(), lambda: _grid(bad=INF)[:, :4], True),
    "nan_in_slice": (lambda: _grid(), lambda: _grid(bad=NAN)[:, :4], True),
    "inf_then_slice": (lambda: _grid(bad=INF), lambda: _grid()[:, :4], True),
    "inf_in_slice_then_slice": (lambda: _grid(bad=INF)[:, :4], lambda: _grid()[:, :4], True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_unscale_of_gradient_layouts_with_inf_and_nan(layout, dtype):
    first, second, has_bad = LAYOUTS[layout]

    def run(cls: type) -> tuple[list[torch.Tensor], float, list[torch.Tensor], float]:
        grads = [first().to(dtype), second().to(dtype)]
        params = [torch.nn.Parameter(torch.zeros(g.shape, dtype=dtype)) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g  # the view itself: its layout is what unscale_ has to handle
        opt = torch.optim.SGD(params, lr=1.0)
        s = cls("cpu", init_scale=4.0, growth_interval=10)
        s.scale(torch.tensor(1.0))  # creates the scale tensor, as the first scale(loss) does
        s.unscale_(opt)
        found = sum(v.item() for v in s._found_inf_per_device(opt).values())
        unscaled = [p.grad.clone() for p in params]
        s.step(opt)
        s.update()
        return unscaled, found, [p.detach().clone() for p in params], s.get_scale()

    want_grads, want_found, want_params, want_scale = run(ampguard.scaler.TorchGradScaler)
    grads, found, params, scale = run(SafeGradScaler)
    assert found == want_found == float(has_bad)
    assert scale == want_scale == (2.0 if has_bad else 4.0)
    for got, want in zip(grads + params, want_grads + want_params):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    if not has_bad:
        assert all(torch.equal(g, torch.ones_like(g)) for g in grads)
        assert all(torch.equal(p, -torch.ones_like(p)) for p in params)  # one SGD step with lr=1


def _unscale_directly(cls: type, grads: list[torch.Tensor], allow_fp16: bool) -> tuple[float, list[torch.Tensor]]:
    """``_unscale_grads_`` (the method SafeGradScaler overrides) on these gradients, scale 4."""
    params = [torch.zeros_like(g) for g in grads]  # tensors, not trainable Parameters: no master weights
    for p, g in zip(params, grads):
        p.grad = g
    opt = torch.optim.SGD(params, lr=1.0)
    found = torch.zeros(1)
    per_device = cls("cpu")._unscale_grads_(opt, torch.full((1,), 0.25), found, allow_fp16)
    return sum(v.item() for v in per_device.values()), [p.grad for p in params]


def _mixed(bad_at: int) -> list[torch.Tensor]:
    grads = [_grid(), _grid()[:, :4], _grid(dtype=torch.float16), _grid(dtype=torch.float16).t()]
    if bad_at >= 0:
        grads[bad_at][1, 2] = INF
    return grads


@pytest.mark.parametrize(
    "bad_at", [-1, 0, 1, 2, 3], ids=["finite", "inf_fp32", "inf_fp32_slice", "inf_fp16", "inf_fp16_t"]
)
def test_unscale_of_mixed_float16_and_float32_gradients(bad_at):
    want_found, want = _unscale_directly(ampguard.scaler.TorchGradScaler, _mixed(bad_at), allow_fp16=True)
    found, got = _unscale_directly(SafeGradScaler, _mixed(bad_at), allow_fp16=True)
    assert found == want_found == float(bad_at >= 0)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
    if bad_at < 0:
        assert all(torch.equal(g, torch.ones_like(g)) for g in got)


def test_float16_gradients_through_unscale_are_what_torch_unscales_where_torch_refuses():
    """Documented difference: torch's ``unscale_`` raises on float16 gradients; ampguard unscales them as torch's kernel."""
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        _unscale_directly(ampguard.scaler.TorchGradScaler, _mixed(-1), allow_fp16=False)
    want_found, want = _unscale_directly(ampguard.scaler.TorchGradScaler, _mixed(2), allow_fp16=True)
    found, got = _unscale_directly(SafeGradScaler, _mixed(2), allow_fp16=False)
    assert found == want_found == 1.0
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


def _sparse(values: list[float], dtype: torch.dtype, indices: list[list[int]] | None = None) -> torch.Tensor:
    indices = indices or [[0, 1, 1], [2, 0, 2]]
    return torch.sparse_coo_tensor(
        torch.tensor(indices), torch.tensor(values), (2, 3), dtype=dtype, check_invariants=True
    )


SPARSE = {
    "fp32_finite": (lambda: _sparse([16.0, 32.0, 64.0], torch.float32), False, 0.0),
    "fp32_inf": (lambda: _sparse([16.0, 32.0, INF], torch.float32), False, 1.0),
    "fp32_nan": (lambda: _sparse([16.0, NAN, 64.0], torch.float32), False, 1.0),
    "fp16_finite": (lambda: _sparse([16.0, 32.0, 64.0], torch.float16), True, 0.0),
    # Two entries at one index: each fits in float16 (60000 < 65504), their sum does not.
    # Checking the uncoalesced values would miss the overflow that coalescing makes.
    "fp16_uncoalesced_sum_overflows": (
        lambda: _sparse([60000.0, 32.0, 60000.0], torch.float16, [[0, 1, 0], [2, 0, 2]]),
        True,
        1.0,
    ),
}


@pytest.mark.parametrize("case", list(SPARSE))
def test_unscale_of_sparse_gradients(case):
    make, allow_fp16, bad = SPARSE[case]
    want_found, (want,) = _unscale_directly(ampguard.scaler.TorchGradScaler, [make()], allow_fp16)
    found, (got,) = _unscale_directly(SafeGradScaler, [make()], allow_fp16)
    assert found == want_found == bad
    assert got.is_sparse and got.is_coalesced() == want.is_coalesced()
    torch.testing.assert_close(got.to_dense(), want.to_dense(), rtol=0, atol=0, equal_nan=True)
    if not bad:
        torch.testing.assert_close(got.to_dense(), (make() / 4).to_dense(), rtol=0, atol=0)


# -- update() ----------------------------------------------------------------------------------------


def test_scale_update_rule_growth_backoff_and_interval():
    """An overflow pattern through the public API: the scale and growth tracker after every update() are torch's."""
    overflows = [False, False, False, True, False, False, False, False, True, True, False, False, False]

    def loop() -> tuple[list[tuple[float, int]], Any]:
        w = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.SGD([w], lr=0.01)
        s = scaler(init_scale=64.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=3)
        seen = []
        for overflow in overflows:
            opt.zero_grad()
            s.scale((w * w).sum()).backward()
            if overflow:
                with torch.no_grad():
                    w.grad[1] = INF  # the gradient, not the loss: ampguard backs off like torch
            s.step(opt)
            s.update()
            seen.append((s.get_scale(), s._get_growth_tracker()))
        return seen, s

    with plain_torch():
        want, torch_scaler = loop()
    got, safe = loop()
    assert type(torch_scaler) is ampguard.scaler.TorchGradScaler and isinstance(safe, SafeGradScaler)
    assert got == want
    assert want[2] == (192.0, 0) and want[3] == (48.0, 0) and want[-1] == (27.0, 0)


def _huge_scale_run(**options: Any) -> tuple[Any, list[float]]:
    torch.manual_seed(0)
    net = torch.nn.Linear(5, 1)
    opt = torch.optim.Adam(net.parameters())
    s = scaler(init_scale=1e38, growth_interval=1, growth_factor=2.0**4, **options)
    x = torch.randn(1, 5)
    y = 1e-30 * torch.randn(1, 1)
    scales = []
    for _ in range(3):
        opt.zero_grad()
        # small enough that even the scaled loss stays finite: the scale is asked to grow past float32
        loss = ((net(x) - y) ** 2).mean() * 1e-3
        s.scale(loss).backward()
        s.step(opt)
        s.update()
        scales.append(s._scale.item())
    return s, scales


def test_scale_never_grows_to_inf():
    with plain_torch():
        _, want = _huge_scale_run()
    assert all(torch.isfinite(torch.tensor(want)))
    _, got = _huge_scale_run()
    # Documented difference: under ampguard the scale is capped at AMPGUARD_MAX_SCALE (2**24) ...
    assert got == [min(w, CAP) for w in want] == [CAP] * 3
    # ... and with the cap at float32's largest value, the scale is torch's, never inf.
    _, uncapped = _huge_scale_run(max_scale=FLOAT32_MAX)
    assert uncapped == want


# -- step(): loops that exercise unscale/step/update together -------------------------------------------


def test_gradient_penalty_from_autograd_grad_of_the_scaled_loss():
    def loop() -> Outcome:
        net = model()
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        s = scaler(init_scale=128.0, growth_interval=1)
        scales = []
        for i, (x, y) in enumerate(batches()):
            opt.zero_grad()
            loss = mse(net(x), y)
            scaled_grads = torch.autograd.grad(s.scale(loss), list(net.parameters()), create_graph=True)
            inv = 1.0 / s.get_scale()
            penalty = torch.stack([(g * inv).pow(2).sum() for g in scaled_grads]).sum().sqrt()
            s.scale(loss + penalty).backward()
            if i == SKIP_AT:
                poison(net)
            s.step(opt)
            s.update()
            scales.append(s.get_scale())
        return Outcome(s, snapshot(net, optimizers=(opt,)), scales)

    reference, result = torch_then_ampguard(loop)
    assert_same(result, reference)
    assert reference.scales[-1] == expected_scale(128.0, grown=ITERATIONS - 1, backed_off=1)


def test_two_step_gradient_accumulation():
    def loop() -> Outcome:
        net = model()
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        s = scaler(init_scale=128.0, growth_interval=1)
        scales = []
        for i, (x, y) in enumerate(batches(6)):
            with torch.autocast("cpu", dtype=torch.float16):
                out = net(x)
            s.scale(mse(out, y) / 2).backward()
            if i % 2 == 1:
                s.step(opt)
                s.update()
                opt.zero_grad()
                scales.append(s.get_scale())
        return Outcome(s, snapshot(net, optimizers=(opt,)), scales)

    reference, result = torch_then_ampguard(loop)
    assert_same(result, reference)
    assert reference.scales == [256.0, 512.0, 1024.0]


def test_two_models_two_optimizers_two_losses():
    """retain_graph, an overflow in one model only, and an explicit unscale_ of one optimizer: one scale for both."""

    def loop() -> Outcome:
        first, second = model(0), model(1)
        opt0 = torch.optim.SGD(first.parameters(), lr=0.05)
        opt1 = torch.optim.Adam(second.parameters(), lr=0.01)
        s = scaler(init_scale=128.0, growth_interval=1)
        scales = []
        for i, (x, y) in enumerate(batches()):
            opt0.zero_grad()
            opt1.zero_grad()
            out0, out1 = first(x), second(x)
            loss0 = mse(0.3 * out0 + 0.7 * out1, y)
            loss1 = mse(0.6 * out0 - 0.4 * out1, y)
            s.scale(loss0).backward(retain_graph=True)
            s.scale(loss1).backward()
            if i == SKIP_AT:
                poison(second)
            s.unscale_(opt0)
            s.step(opt0)  # opt0's gradients were finite: it steps even in the skipped iteration
            s.step(opt1)
            s.update()
            scales.append(s.get_scale())
        return Outcome(s, snapshot(first, second, optimizers=(opt0, opt1)), scales)

    reference, result = torch_then_ampguard(loop)
    assert_same(result, reference)
    assert reference.scales[-1] == expected_scale(128.0, grown=ITERATIONS - 1, backed_off=1)


def test_unscale_then_clip_with_a_skipped_step():
    """The documented recipe (unscale_, then clip with the unscaled threshold), an inf injected before unscale_."""

    def loop() -> Outcome:
        net = model()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        s = scaler(init_scale=128.0, growth_interval=1)
        scales = []
        norms = []
        for i, (x, y) in enumerate(batches()):
            opt.zero_grad()
            s.scale(mse(net(x), y)).backward()
            if i == SKIP_AT:
                poison(net)
            s.unscale_(opt)
            norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.2, error_if_nonfinite=False))
            s.step(opt)
            s.update()
            scales.append(s.get_scale())
        return Outcome(s, snapshot(net, optimizers=(opt,)) + norms, scales)

    reference, result = torch_then_ampguard(loop)
    assert_same(result, reference)


# -- gradients invalidated between unscale_ and step --------------------------------------------------


@pytest.mark.parametrize("opt_class, options", OPTIMIZERS)
def test_gradients_invalidated_after_unscale_are_stepped_as_torch_steps_them(opt_class, options):
    """torch checks for inf/NaN at unscale_; gradients broken afterwards are stepped, and the parameters break.

    ampguard does what torch does: the same non-finite parameters, gradients and
    optimizer state. The scale differs after the first iteration, on purpose: from
    then on the loss itself is NaN (the parameters are), torch halves the scale
    each time and ampguard does not back off, since no scale makes a NaN loss
    finite: the scale and the growth tracker stay as they were (docs/islands.md).
    """

    def loop() -> Outcome:
        net = model()
        opt = opt_class(net.parameters(), **options)
        s = scaler(init_scale=128.0, growth_interval=1)
        scales = []
        for x, y in batches(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = net(x)
            s.scale(mse(out, y)).backward()
            s.unscale_(opt)
            with torch.no_grad():
                for j, p in enumerate(net.parameters()):
                    p.grad.fill_(INF if j % 2 else NAN)
            s.step(opt)
            s.update()
            scales.append(s.get_scale())
        return Outcome(s, snapshot(net, optimizers=(opt,)), scales)

    reference, result = torch_then_ampguard(loop)
    params = reference.tensors[0:8:2]  # snapshot() interleaves each parameter with its gradient
    assert len(params) == 4 and all(not torch.isfinite(p).all() for p in params)
    assert_same(replace(result, scales=reference.scales), reference)
    # The first step counted as a good one in both (found_inf was 0 at unscale_), so the scale grew.
    assert reference.scales == [256.0, 128.0, 64.0]
    # The scale and the growth tracker stay (before a fix in issue 26: 512, 1024). Fused optimizers too: on the
    # CPU the verdict is known at the update (on a GPU it arrives later, and the iteration counts toward growth).
    assert result.scales == [256.0, 256.0, 256.0]


# -- optimizers that handle the scale themselves (_step_supports_amp_scaling) ------------------------


class TakesTheScaler(torch.optim.SGD):
    """The older contract: ``step`` takes ``grad_scaler=`` and unscales and checks on its own."""

    _step_supports_amp_scaling = True

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.1)
        self.seen: list[tuple[Any, bool]] = []

    def step(self, closure: Any = None, *, grad_scaler: Any = None) -> None:  # type: ignore[override]
        self.seen.append((grad_scaler, hasattr(self, "grad_scale") or hasattr(self, "found_inf")))
        grad_scaler.unscale_(self)
        found = sum(v.item() for v in grad_scaler._found_inf_per_device(self).values())
        if not found:
            super().step(closure)


class TakesTensors(DeviceSkipSGD):
    """The newer contract: the scaler sets ``grad_scale`` and ``found_inf`` for the length of ``step``."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.1)
        self.seen: list[tuple[Any, Any]] = []

    def step(self, closure: Any = None) -> None:
        self.seen.append((self.grad_scale.clone(), self.found_inf.clone()))
        super().step(closure)


def _self_scaling_loop(opt_class: type) -> tuple[Outcome, torch.optim.Optimizer, list[bool]]:
    net = model()
    opt = opt_class(net.parameters())
    attributes_left = []

    def after_update(s: Any) -> Any:
        attributes_left.append(hasattr(opt, "grad_scale") or hasattr(opt, "found_inf"))
        return s

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s, scales = _train(scaler(), net, opt, batches(), after_update=after_update)
    future = [w for w in caught if w.category is FutureWarning and "stop passing itself" in str(w.message)]
    assert len(future) == (ITERATIONS if opt_class is TakesTheScaler else 0)  # torch's warning, once per step
    return Outcome(s, snapshot(net), scales), opt, attributes_left


def test_optimizer_with_a_grad_scaler_keyword_receives_the_scaler():
    with plain_torch():
        reference, _torch_opt, _ = _self_scaling_loop(TakesTheScaler)
    result, opt, _ = _self_scaling_loop(TakesTheScaler)
    assert type(reference.scaler) is ampguard.scaler.TorchGradScaler and isinstance(result.scaler, SafeGradScaler)
    assert [(scaler is result.scaler, attrs) for scaler, attrs in opt.seen] == [(True, False)] * ITERATIONS
    assert all(isinstance(scaler, torch.amp.GradScaler) for scaler, _ in opt.seen)
    assert_same(result, reference)
    assert reference.scales[-1] == expected_scale(128.0, grown=ITERATIONS - 1, backed_off=1)


def test_optimizer_without_the_keyword_gets_grad_scale_and_found_inf_during_step():
    with plain_torch():
        reference, torch_opt, torch_left = _self_scaling_loop(TakesTensors)
    result, opt, left = _self_scaling_loop(TakesTensors)
    assert type(reference.scaler) is ampguard.scaler.TorchGradScaler and isinstance(result.scaler, SafeGradScaler)
    assert left == torch_left == [False] * ITERATIONS  # removed again after step
    for (scale, found), (want_scale, want_found) in zip(opt.seen, torch_opt.seen, strict=True):
        assert torch.equal(scale, want_scale) and torch.equal(found, want_found)
    assert [found.item() for _, found in opt.seen] == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert_same(result, reference)
