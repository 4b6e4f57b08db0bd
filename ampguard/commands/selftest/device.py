"""What the device is: its bfloat16 (native or emulated, measured against float16), and the legacy AMP spellings.

The bf16 check holds the doctor's recommendation for this device
(:func:`ampguard.machine.recommend`, which goes by compute capability) against
a measurement: a native-bf16 GPU must run a bfloat16 matmul about as fast as a
float16 one. The legacy-spellings check runs ``torch.cuda.amp.autocast`` and
``torch.cuda.amp.GradScaler`` with warnings recorded, on plain torch (the
reference: they warn on torch 2.4+) and under ampguard (they must not).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any

import torch

import ampguard.machine as machine
from ampguard.commands.selftest.result import CheckResult, Context, not_applicable, seeded, verdict
from ampguard.commands.selftest.runner import patch_states, plain_torch
from ampguard.scaler import SafeGradScaler

# bfloat16 matmul time over float16's above which "native bfloat16" is not believable.
NATIVE_SLOWDOWN_LIMIT = 2.0


def matmul_seconds(context: Context, dtype: torch.dtype, size: int, repeats: int) -> float:
    """The best of ``repeats`` timings of one ``size`` x ``size`` matmul in ``dtype`` on the device."""
    with seeded(0):
        a, b = (torch.randn(size, size).to(context.device, dtype) for _ in range(2))
    a @ b  # warm-up: kernel selection, lazy initialisation
    best = float("inf")
    for _ in range(repeats):
        context.synchronize()
        started = time.perf_counter()
        a @ b
        context.synchronize()
        best = min(best, time.perf_counter() - started)
    return best


def bf16_slowdown(context: Context) -> float:
    """bfloat16 matmul time over float16's (CPU: a small matmul, float16 matmuls are slow there)."""
    size, repeats = (1024, 5 if context.quick else 20) if context.device.type == "cuda" else (96, 3)
    return matmul_seconds(context, torch.bfloat16, size, repeats) / matmul_seconds(
        context, torch.float16, size, repeats
    )


def bf16_judgement(native: bool | None, slowdown: float, precision: str) -> tuple[bool, str]:
    """Whether the doctor's ``precision`` for a GPU with ``native`` bfloat16 fits the measured ``slowdown``."""
    if native is None:  # ROCm: no capability rule; the doctor goes by torch's answer
        return True, f"ROCm: the doctor recommends {precision}; bfloat16 matmul {slowdown:.2f}x float16's time"
    expected = "bf16" if native else "fp16"
    if precision != expected:
        return False, f"the doctor recommends {precision} for a GPU {'with' if native else 'without'} native bfloat16"
    if native and slowdown > NATIVE_SLOWDOWN_LIMIT:
        return (
            False,
            f"native bfloat16 by its compute capability, yet a bfloat16 matmul takes {slowdown:.2f}x float16's time",
        )
    kind = "native" if native else "emulated"
    return True, f"{kind} bfloat16 (bfloat16 matmul {slowdown:.2f}x float16's time): the doctor recommends {precision}"


def bf16_truth(context: Context) -> CheckResult:
    name = "bf16_truth"
    slowdown = bf16_slowdown(context)
    report = machine.cuda_report()
    if context.device.type != "cuda":
        advice = machine.recommend(report)
        return not_applicable(
            name,
            f"CPU: the doctor recommends {advice.precision} (no GPU); bfloat16 matmul {slowdown:.2f}x float16's time",
            {"bf16_over_fp16_time": slowdown},
            {"doctor": advice.precision},
        )
    gpu = machine.gpu_info(context.device.index if context.device.index is not None else torch.cuda.current_device())
    advice = machine.recommend(dataclasses.replace(report, gpus=[gpu]))
    ok, detail = bf16_judgement(gpu.bf16_native, slowdown, advice.precision)
    measured = {"bf16_over_fp16_time": slowdown, "torch_is_bf16_supported": report.torch_says_bf16}
    reference = {"bf16_native": gpu.bf16_native, "capability": gpu.as_dict()["capability"], "doctor": advice.precision}
    return verdict(name, ok, measured, reference, f"{gpu.name}: {detail}")


def use_legacy_spellings(context: Context, autocast: Any, grad_scaler: Any) -> tuple[list[str], torch.dtype, Any]:
    """(FutureWarnings, the autocast output dtype, the scaler) of one use of the legacy classes."""
    with seeded(0):
        layer = torch.nn.Linear(4, 4)
    layer.to(context.device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with autocast(dtype=torch.float16):
            out = layer(torch.ones(2, 4, device=context.device))
        scaler = grad_scaler()
    return [str(w.message).splitlines()[0] for w in caught if issubclass(w.category, FutureWarning)], out.dtype, scaler


def legacy_check(context: Context, autocast: Any, grad_scaler: Any) -> CheckResult:
    name = "legacy_spellings"
    with plain_torch():
        torch_warnings, torch_dtype, _ = use_legacy_spellings(context, autocast, grad_scaler)
    ours, dtype, scaler = use_legacy_spellings(context, autocast, grad_scaler)
    safe_expected = patch_states().get("grad_scaler") == "applied"
    measured = {"future_warnings": ours, "autocast_dtype": str(dtype), "scaler": type(scaler).__qualname__}
    reference = {"future_warnings": torch_warnings, "autocast_dtype": str(torch_dtype)}
    ok = (
        not ours and dtype == torch_dtype == torch.float16 and (isinstance(scaler, SafeGradScaler) or not safe_expected)
    )
    detail = (
        f"{autocast.__module__}.autocast and GradScaler: {len(ours)} FutureWarnings (plain torch {len(torch_warnings)}), "
        f"autocast gives {dtype}, the scaler is a {type(scaler).__qualname__}"
    )
    return verdict(name, ok, measured, reference, detail)


def legacy_spellings(context: Context) -> CheckResult:
    if context.device.type != "cuda":
        return not_applicable("legacy_spellings", "torch.cuda.amp.autocast / GradScaler need a CUDA device")
    return legacy_check(context, torch.cuda.amp.autocast, torch.cuda.amp.GradScaler)
