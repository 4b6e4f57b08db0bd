"""Patch bf16_check: bf16 autocast on a GPU without native bf16 warns once, or falls back to fp16.

These machines have no GPU: the device is mocked (test names say so). On a
CPU-only run torch itself then disables the CUDA autocast region ("CUDA is not
available"), but the dtype the region was given is still visible as
``fast_dtype``, which is what the fallback changes.
"""

from __future__ import annotations

import inspect
import logging
import types
import warnings

import pytest
import torch

import ampguard
from ampguard import machine, registry
from ampguard.patches import bf16_check

T4 = machine.GpuInfo(index=0, name="Tesla T4", capability=(7, 5), total_memory_gib=15.0, bf16_native=False)
A100 = machine.GpuInfo(
    index=0, name="NVIDIA A100-SXM4-40GB", capability=(8, 0), total_memory_gib=40.0, bf16_native=True
)


def bf16_check_patch() -> bf16_check.Bf16CheckPatch:
    from ampguard.registry import _registry

    return next(p for p in _registry.patches if p.name == "bf16_check")


@pytest.fixture(autouse=True)
def _warn_once_again():
    """The WARNING is once per installation: each test starts as if freshly installed."""
    bf16_check_patch().warned = False
    yield


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch):
    """``gpu(info)``: pretend the current CUDA device is ``info`` (None: no CUDA)."""

    def _set(info: machine.GpuInfo | None) -> None:
        monkeypatch.setattr(machine, "current_cuda_gpu", lambda: info)

    return _set


def _autocast(*args, **kwargs) -> torch.amp.autocast_mode.autocast:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available. Disabling autocast." on this machine
        return torch.autocast(*args, **kwargs)


def _warnings_from(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ampguard" and r.levelno == logging.WARNING]


def test_patch_is_on_by_default():
    state = {s.name: s.state for s in ampguard.status()}
    assert state["bf16_check"] == "applied"


def test_mocked_t4_bf16_autocast_warns_once(gpu, caplog):
    gpu(T4)
    with caplog.at_level(logging.WARNING, logger="ampguard"):
        first = _autocast("cuda", dtype=torch.bfloat16)
        for _ in range(3):
            _autocast("cuda", dtype=torch.bfloat16)
    messages = _warnings_from(caplog)
    assert len(messages) == 1
    assert "Tesla T4, compute capability 7.5" in messages[0]
    assert "no native bfloat16" in messages[0] and "AMPGUARD_BF16_FALLBACK=fp16" in messages[0]
    assert first.fast_dtype is torch.bfloat16  # warning only: the region keeps what was asked


def test_mocked_a100_is_silent(gpu, caplog):
    gpu(A100)
    with caplog.at_level(logging.DEBUG, logger="ampguard"):
        region = _autocast("cuda", dtype=torch.bfloat16)
    assert _warnings_from(caplog) == []
    assert region.fast_dtype is torch.bfloat16


def test_mocked_t4_fp16_and_disabled_regions_are_silent(gpu, caplog):
    gpu(T4)
    with caplog.at_level(logging.WARNING, logger="ampguard"):
        assert _autocast("cuda", dtype=torch.float16).fast_dtype is torch.float16
        assert _autocast("cuda", dtype=torch.bfloat16, enabled=False).fast_dtype is torch.bfloat16
        _autocast("cpu", dtype=torch.bfloat16)
    assert _warnings_from(caplog) == []


def test_no_cuda_device_is_silent(gpu, caplog):
    gpu(None)
    with caplog.at_level(logging.WARNING, logger="ampguard"):
        _autocast("cuda", dtype=torch.bfloat16)
    assert _warnings_from(caplog) == []


def test_mocked_t4_fallback_runs_region_in_fp16(gpu, reinstall, caplog):
    reinstall(AMPGUARD_BF16_FALLBACK="fp16")
    gpu(T4)
    with caplog.at_level(logging.WARNING, logger="ampguard"):
        regions = [_autocast("cuda", dtype=torch.bfloat16) for _ in range(2)]
        keyword = _autocast(device_type="cuda", dtype=torch.bfloat16, enabled=True, cache_enabled=False)
    assert all(r.fast_dtype is torch.float16 for r in [*regions, keyword])
    assert keyword._cache_enabled is False
    messages = _warnings_from(caplog)
    assert len(messages) == 1
    assert "run in float16" in messages[0] and "GradScaler" in messages[0]


def test_mocked_t4_fallback_reaches_legacy_and_default_dtype_spellings(gpu, reinstall, monkeypatch):
    reinstall(AMPGUARD_BF16_FALLBACK="fp16")
    gpu(T4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        legacy = torch.cuda.amp.autocast(dtype=torch.bfloat16)
        assert legacy.fast_dtype is torch.float16
        monkeypatch.setattr(bf16_check, "_default_cuda_dtype", lambda: torch.bfloat16)
        assert torch.autocast("cuda").fast_dtype is torch.float16


def test_mocked_a100_fallback_keeps_bf16(gpu, reinstall):
    reinstall(AMPGUARD_BF16_FALLBACK="fp16")
    gpu(A100)
    assert _autocast("cuda", dtype=torch.bfloat16).fast_dtype is torch.bfloat16


def test_mocked_device_properties_through_torch_cuda(monkeypatch, caplog):
    """The real capability lookup (machine.current_cuda_gpu), with torch.cuda's answers mocked."""
    properties = types.SimpleNamespace(name="TITAN RTX", major=7, minor=5, total_memory=24 * 2**30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: properties)
    machine.gpu_info.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="ampguard"):
            bf16_check_patch().checked_dtype(torch.bfloat16)
        assert machine.current_cuda_gpu() == machine.GpuInfo(0, "TITAN RTX", (7, 5), 24.0, False)
    finally:
        machine.gpu_info.cache_clear()
    messages = _warnings_from(caplog)
    assert len(messages) == 1 and "TITAN RTX, compute capability 7.5" in messages[0]


def test_a_failing_capability_lookup_never_breaks_autocast(monkeypatch):
    def broken() -> None:
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(machine, "current_cuda_gpu", broken)
    assert _autocast("cuda", dtype=torch.bfloat16).fast_dtype is torch.bfloat16


def test_class_identity_and_signature_are_kept():
    cls = torch.amp.autocast_mode.autocast
    assert torch.autocast is cls and torch.amp.autocast is cls
    assert tuple(inspect.signature(cls).parameters) == ("device_type", "dtype", "enabled", "cache_enabled")
    assert vars(cls)["__init__"].__name__ == "__init__"


def test_revert_restores_torchs_init(stock_torch):
    init = vars(torch.amp.autocast_mode.autocast)["__init__"]
    assert init.__module__.startswith("torch.")


def test_disable_leaves_autocast_alone(reinstall, gpu, caplog):
    reinstall(AMPGUARD_DISABLE="bf16_check")
    gpu(T4)
    assert vars(torch.amp.autocast_mode.autocast)["__init__"].__module__.startswith("torch.")
    with caplog.at_level(logging.WARNING, logger="ampguard"):
        _autocast("cuda", dtype=torch.bfloat16)
    assert _warnings_from(caplog) == []


def test_cpu_bf16_autocast_still_works():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.randn(4, 4) @ torch.randn(4, 4)
    assert out.dtype is torch.bfloat16


def _region_inside(x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return torch.relu(x @ x).sum()


def test_compile_fullgraph_with_autocast_inside():
    torch._dynamo.reset()
    compiled = torch.compile(_region_inside, fullgraph=True, backend="eager")
    x = torch.randn(8, 8)
    result = compiled(x)
    assert result.dtype is torch.bfloat16
    torch.testing.assert_close(result, _region_inside(x))


def test_compile_fullgraph_with_region_created_outside():
    torch._dynamo.reset()
    region = torch.autocast("cpu", dtype=torch.bfloat16)

    def entered_inside(x: torch.Tensor) -> torch.Tensor:
        with region:
            return (x @ x).sum()

    assert torch.compile(entered_inside, fullgraph=True, backend="eager")(torch.randn(4, 4)).dtype is torch.bfloat16


def test_a_cpu_region_does_no_check_work(monkeypatch):
    """Regions that are not enabled-CUDA cost one string comparison: nothing of the check runs.

    (The time is measured, not asserted: docs/troubleshooting.md gives the numbers.)
    """

    def must_not_run(*args, **kwargs):
        raise AssertionError("the bf16 check ran for a region that is not an enabled CUDA one")

    patch = next(p for p in registry._registry.patches if p.name == "bf16_check")
    monkeypatch.setattr(patch, "checked_dtype", must_not_run)
    monkeypatch.setattr(machine, "current_cuda_gpu", must_not_run)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype is torch.bfloat16
    torch.cuda.amp.autocast(enabled=False)
    torch.autocast("cuda", dtype=torch.bfloat16, enabled=False)
