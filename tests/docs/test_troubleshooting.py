"""docs/troubleshooting.md: every reproduction in it runs, shows its symptom on stock torch, and ampguard's answer.

The code blocks of the page that start with ``# reproduction: <name>`` are
executed as written (CUDA-only ones with a CPU stand-in, as the page says), so
the page cannot drift from what torch and ampguard do.
"""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ampguard
import ampguard.scaler.crashes
from ampguard import machine
from ampguard.patch import torch_release

DOCS = Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md"
BLOCK = re.compile(r"```python\n# reproduction: ([\w-]+)[^\n]*\n(.*?)```", re.S)


def reproductions() -> dict[str, str]:
    return {name: code for name, code in BLOCK.findall(DOCS.read_text())}


def run(name: str, replacements: dict[str, str] | None = None) -> dict[str, Any]:
    """Execute the page's reproduction ``name``; its namespace, with ``printed`` holding what it printed."""
    code = reproductions()[name]
    for old, new in (replacements or {}).items():
        assert old in code, f"{old!r} not in reproduction {name}"
        code = code.replace(old, new)
    printed: list[str] = []
    namespace: dict[str, Any] = {
        "print": lambda *args: printed.append(" ".join(str(a) for a in args)),
        "printed": printed,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        exec(compile(code, f"docs/troubleshooting.md:{name}", "exec"), namespace)
    return namespace


def ampguard_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ampguard" and r.levelno >= logging.WARNING]


def test_every_entry_of_issue_6_has_a_reproduction():
    assert set(reproductions()) == {
        "device-mismatch",
        "no-inf-checks",
        "fp16-gradients",
        "initial-scale",
        "clip-scaled",
        "deprecated-amp-api",
        "bf16-pre-ampere",
        "bf16-unscale-cuda",
        "labels-vs-label-ids",
        "skip-by-scale",
    }
    for name, code in reproductions().items():
        compile(code, name, "exec")  # the GPU-only ones at least parse


# -- device mismatch (GPU only: "meta" stands in for "cuda") ---------------------------------------


@pytest.mark.parametrize("torch_kind", ["stock", "ampguard"])
def test_device_mismatch_is_the_same_with_and_without_ampguard(torch_kind, request):
    if torch_kind == "stock":
        request.getfixturevalue("stock_torch")
    namespace = run("device-mismatch", {'device = "cuda"': 'device = "meta"'})
    [error] = namespace["printed"]
    assert "device" in error and "meta" in error and "cpu" in error
    assert namespace["loss"].device.type == "meta"  # the fix works


# -- No inf checks ----------------------------------------------------------------------------------


def test_no_inf_checks_symptom_on_stock_torch(stock_torch):
    with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer"):
        run("no-inf-checks")


def test_no_inf_checks_handled(caplog):
    with caplog.at_level(logging.WARNING, logger="ampguard"):
        namespace = run("no-inf-checks")
    assert namespace["scaler"].stats.no_grad_steps == 1
    [message] = ampguard_warnings(caplog)
    assert "No inf checks were recorded for this optimizer" in message and "frozen" in message


# -- fp16 gradients ---------------------------------------------------------------------------------


def test_fp16_gradients_symptom_on_stock_torch(stock_torch):
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        run("fp16-gradients")


def test_fp16_gradients_handled(caplog):
    with caplog.at_level(logging.INFO, logger="ampguard"):
        namespace = run("fp16-gradients")
    assert namespace["scaler"].stats.skipped == 0
    assert all(p.dtype is torch.float16 and torch.isfinite(p).all() for p in namespace["model"].parameters())
    assert not ampguard_warnings(caplog)
    assert any(
        "keeps float32 master copies of 2 float16 parameter tensors with 5 values" in r.getMessage()
        for r in caplog.records
    )
    assert all(
        s["momentum_buffer"] is None or s["momentum_buffer"].dtype == torch.float32
        for s in namespace["optimizer"].state.values()
    )


def test_fp16_gradients_without_master_weights_warn_once(caplog, reinstall):
    reinstall(AMPGUARD_MASTER_WEIGHTS="off")
    with caplog.at_level(logging.WARNING, logger="ampguard"):
        namespace = run("fp16-gradients")
    assert all(p.dtype is torch.float16 and torch.isfinite(p).all() for p in namespace["model"].parameters())
    assert any("Attempting to unscale FP16 gradients" in m and "float32" in m for m in ampguard_warnings(caplog))


# -- initial scale ----------------------------------------------------------------------------------


def test_initial_scale_symptom_on_stock_torch(stock_torch):
    namespace = run("initial-scale")
    assert namespace["printed"] == ["32768.0"]  # the first step was skipped


def test_initial_scale_handled(caplog):
    with caplog.at_level(logging.INFO, logger="ampguard"):
        namespace = run("initial-scale")
    assert namespace["printed"] == ["1024.0"]
    assert namespace["scaler"].stats.skipped == 0


def test_a_too_high_scale_is_explained_as_backward_overflow(caplog):
    """Even at torch's 65536 under ampguard, the skip is described: backward overflow, which layer."""
    with caplog.at_level(logging.INFO, logger="ampguard"):
        namespace = run(
            "initial-scale", {'torch.amp.GradScaler("cpu")': 'torch.amp.GradScaler("cpu", init_scale=65536.0)'}
        )
    assert namespace["scaler"].stats.skipped == 1
    described = [r.getMessage() for r in caplog.records if "skipped at loss scale 65536" in r.getMessage()]
    assert described and "backward overflow" in described[0] and "param_groups[0][0] (16x16 float32)" in described[0]


# -- clipping scaled gradients ----------------------------------------------------------------------

RECIPE = {
    "norm = torch.nn.utils.clip_grad_norm_(": "scaler.unscale_(optimizer)\nnorm = torch.nn.utils.clip_grad_norm_("
}


def test_clip_scaled_symptom_on_stock_torch(stock_torch):
    forgot, recipe = run("clip-scaled"), run("clip-scaled", RECIPE)
    assert float(forgot["norm"]) == pytest.approx(1024 * float(recipe["norm"]), rel=1e-3)
    moved = [(p - q).norm() for p, q in zip(forgot["model"].parameters(), recipe["model"].parameters())]
    assert max(moved) > 1e-3  # a different (much smaller) update than the recipe's


def test_clip_scaled_handled():
    if {s.name: s.state for s in ampguard.status()}.get("clip_grad") != "applied":
        pytest.fail("the clip_grad patch is not applied: scaled clipping is not handled")
    forgot, recipe = run("clip-scaled"), run("clip-scaled", RECIPE)
    assert float(forgot["norm"]) == pytest.approx(float(recipe["norm"]), rel=1e-4)
    for p, q in zip(forgot["model"].parameters(), recipe["model"].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


# -- deprecated spellings ---------------------------------------------------------------------------


def test_deprecation_warnings_symptom_on_stock_torch(stock_torch):
    expected = 2 if torch_release() >= torch_release("2.4") else 0  # torch 2.3 did not deprecate them yet
    assert run("deprecated-amp-api")["printed"] == [str(expected)]


def test_deprecation_warnings_handled():
    namespace = run("deprecated-amp-api")
    assert namespace["printed"] == ["0"]
    assert isinstance(namespace["scaler"], ampguard.SafeGradScaler)


# -- bf16 on pre-Ampere (GPU only: the device is mocked) ---------------------------------------------

T4 = machine.GpuInfo(index=0, name="Tesla T4", capability=(7, 5), total_memory_gib=15.0, bf16_native=False)


def test_bf16_pre_ampere_mocked_t4_warns(monkeypatch, caplog):
    from ampguard.registry import _registry

    patch = next(p for p in _registry.patches if p.name == "bf16_check")
    monkeypatch.setattr(patch, "warned", False)  # once per installation: as if freshly installed
    monkeypatch.setattr(machine, "current_cuda_gpu", lambda: T4)
    with caplog.at_level(logging.WARNING, logger="ampguard"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.autocast("cuda", dtype=torch.bfloat16)
    assert any("no native bfloat16" in m for m in ampguard_warnings(caplog))


def test_bf16_pre_ampere_symptom_is_torch_claiming_support_mocked(stock_torch, monkeypatch):
    """What torch does on a 7.5 device whose bf16 tensors work (emulation): it says 'supported'."""
    props = type("Props", (), {"major": 7, "minor": 5, "name": "Tesla T4"})()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda device: True, raising=False)
    assert torch.cuda.is_bf16_supported() is True
    assert machine.has_native_bf16((props.major, props.minor)) is False


# -- bf16 gradients under an fp16 scaler on CUDA ----------------------------------------------------

CPU_STAND_IN = {'"cuda"': '"cpu"'}


def _cuda_like_unscale_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the unscale kernel what it is on CUDA: no bfloat16 implementation (pytorch issue 127176)."""
    kernel = torch._amp_foreach_non_finite_check_and_unscale_

    def without_bf16(grads, found_inf, inv_scale):
        if any(g.dtype is torch.bfloat16 for g in grads):
            raise RuntimeError("\"_amp_foreach_non_finite_check_and_unscale_cuda\" not implemented for 'BFloat16'")
        return kernel(grads, found_inf, inv_scale)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", without_bf16)


def test_bf16_unscale_symptom_on_stock_torch(stock_torch, monkeypatch):
    _cuda_like_unscale_kernel(monkeypatch)
    with pytest.raises(RuntimeError, match="not implemented for 'BFloat16'"):
        run("bf16-unscale-cuda", CPU_STAND_IN)


def test_bf16_unscale_handled_on_the_cuda_path(monkeypatch):
    with_kernel = run("bf16-unscale-cuda", CPU_STAND_IN)  # CPU: the kernel has bfloat16
    _cuda_like_unscale_kernel(monkeypatch)
    monkeypatch.setattr(ampguard.scaler.crashes, "DEVICES_WITHOUT_BF16_UNSCALE", frozenset({"cpu", "cuda"}))
    without_kernel = run("bf16-unscale-cuda", CPU_STAND_IN)
    assert without_kernel["scaler"].stats.skipped == 0
    for p, q in zip(without_kernel["model"].parameters(), with_kernel["model"].parameters()):
        assert p.dtype is torch.bfloat16 and torch.equal(p, q)


def test_bf16_unscale_without_the_kernel_matches_the_kernel(monkeypatch):
    """ampguard's kernel-free unscale gives the CPU kernel's gradients and overflow flag."""
    torch.manual_seed(0)
    grads = [torch.randn(5, 3, dtype=torch.bfloat16) * 1024, torch.randn(7, dtype=torch.bfloat16) * 1024]
    ours = [g.clone() for g in grads]
    inv_scale = torch.tensor(1 / 1024.0)
    found_kernel, found_ours = torch.zeros(1), torch.zeros(1)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_kernel, inv_scale)
    ampguard.scaler.crashes.unscale_without_kernel_(ours, found_ours, inv_scale)
    for a, b in zip(grads, ours):
        assert torch.equal(a, b)
    assert found_kernel.item() == found_ours.item() == 0.0
    ours[1][2] = float("inf")
    ampguard.scaler.crashes.unscale_without_kernel_(ours, found_ours, inv_scale)
    assert found_ours.item() == 1.0


# -- labels vs label_ids ----------------------------------------------------------------------------


@pytest.mark.parametrize("torch_kind", ["stock", "ampguard"])
def test_labels_vs_label_ids_is_not_an_amp_problem(torch_kind, request):
    if torch_kind == "stock":
        request.getfixturevalue("stock_torch")
    namespace = run("labels-vs-label-ids")
    assert len(namespace["printed"]) == 1
    assert "got an unexpected keyword argument 'labels'" in namespace["printed"][0]
    assert torch.isfinite(namespace["loss"])


# -- skip detection by a scale drop -------------------------------------------------------------------


def test_skip_by_scale_symptom_counts_every_skip_on_stock_torch(stock_torch):
    assert run("skip-by-scale")["printed"] == ["2"]


def test_skip_by_scale_misses_forward_overflows_under_ampguard_and_last_step_skipped_sees_them():
    namespace = run("skip-by-scale")
    assert namespace["printed"] == ["0"]
    assert namespace["scaler"].stats.skipped == namespace["scaler"].stats.nonfinite_loss == 2
    fixed = run("skip-by-scale", {"scaler.get_scale() < scale_before": "scaler.last_step_skipped"})
    assert fixed["printed"] == ["2"]
