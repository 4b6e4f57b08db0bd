"""What this machine can do: Python, torch, CUDA, each GPU and the truth about its bfloat16.

``torch.cuda.is_bf16_supported()`` returns True on a T4 or a TITAN RTX (compute
capability 7.5) because emulated bfloat16 counts; emulation is far slower than
float16 and cuDNN has no bfloat16 convolution there. The honest test is the
compute capability: 8.0 (Ampere) or newer has native bfloat16.

Nothing here raises: a machine without a GPU, a CPU-only torch build or a
broken driver all give an answer (an empty GPU list, an error string). Trainer
libraries are looked up through their package metadata, never imported.
"""

from __future__ import annotations

import functools
import os
import platform
import sys
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

NATIVE_BF16_CAPABILITY: tuple[int, int] = (8, 0)

# Distribution names (as pip knows them) of the libraries that drive training
# loops ampguard patches under; looked up by metadata only.
TRAINER_DISTRIBUTIONS: tuple[str, ...] = (
    "accelerate",
    "transformers",
    "peft",
    "trl",
    "diffusers",
    "lightning",
    "pytorch-lightning",
    "lightning-fabric",
    "coqui-tts-trainer",
    "trainer",
    "coqui-tts",
    "TTS",
    "timm",
    "deepspeed",
    "fairseq",
    "fairseq2",
    "nemo_toolkit",
    "megatron-core",
    "apex",
    "bitsandbytes",
)


@dataclass(frozen=True)
class GpuInfo:
    """One CUDA (or ROCm) device as torch sees it.

    ``bf16_native`` is None on ROCm, where the "capability" torch reports is a
    gfx architecture number, not an sm version.
    """

    index: int
    name: str
    capability: tuple[int, int]
    total_memory_gib: float
    bf16_native: bool | None

    @property
    def label(self) -> str:
        major, minor = self.capability
        return f"cuda:{self.index} ({self.name}, compute capability {major}.{minor})"

    def as_dict(self) -> dict[str, Any]:
        major, minor = self.capability
        return {
            "index": self.index,
            "name": self.name,
            "capability": f"{major}.{minor}",
            "total_memory_gib": round(self.total_memory_gib, 2),
            "bf16_native": self.bf16_native,
        }


def has_native_bf16(capability: tuple[int, int]) -> bool:
    """Native bfloat16 arithmetic: compute capability 8.0 (Ampere) or newer."""
    return tuple(capability) >= NATIVE_BF16_CAPABILITY


def is_rocm() -> bool:
    return bool(getattr(torch.version, "hip", None))


@functools.lru_cache(maxsize=64)
def gpu_info(index: int) -> GpuInfo:
    """The properties of CUDA device ``index`` (cached: they do not change while the process runs)."""
    props = torch.cuda.get_device_properties(index)
    capability = (int(props.major), int(props.minor))
    return GpuInfo(
        index=index,
        name=str(props.name),
        capability=capability,
        total_memory_gib=props.total_memory / 2**30,
        bf16_native=None if is_rocm() else has_native_bf16(capability),
    )


def current_cuda_gpu() -> GpuInfo | None:
    """The current CUDA device, or None when CUDA cannot be used in this process.

    Cheap enough to call whenever a CUDA autocast region is created: one
    device-count check, one current-device call and a cache lookup.
    """
    if not torch.cuda.is_available():
        return None
    return gpu_info(torch.cuda.current_device())


@dataclass
class CudaReport:
    """CUDA as seen from this process: the build, the devices, and what went wrong if anything."""

    build: str | None
    hip: str | None
    cudnn: int | None
    available: bool
    gpus: list[GpuInfo] = field(default_factory=list)
    torch_says_bf16: bool | None = None
    error: str | None = None


def cuda_report() -> CudaReport:
    """Every visible GPU; never raises (a driver problem becomes ``error``)."""
    report = CudaReport(
        build=torch.version.cuda,
        hip=getattr(torch.version, "hip", None),
        cudnn=_cudnn_version(),
        available=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            report.available = bool(torch.cuda.is_available())
            if report.available:
                report.gpus = [gpu_info(i) for i in range(torch.cuda.device_count())]
                report.torch_says_bf16 = bool(torch.cuda.is_bf16_supported())
        except Exception as error:  # a broken driver must not break the doctor
            report.error = f"{type(error).__name__}: {error}"
    if report.error is None and not report.available and caught:
        # torch explains a missing or too old driver only through a warning.
        report.error = str(caught[0].message).strip().splitlines()[0]
    return report


def _cudnn_version() -> int | None:
    try:
        backend = torch.backends.cudnn
        return int(backend.version()) if backend.is_available() else None
    except Exception:
        return None


def installed_libraries(names: tuple[str, ...] = TRAINER_DISTRIBUTIONS) -> dict[str, str]:
    """``{distribution: version}`` for each of ``names`` that is installed (metadata only, nothing imported)."""
    import importlib.metadata  # only the doctor asks; not at every import of ampguard

    found: dict[str, str] = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        except Exception:  # broken metadata of one package must not hide the others
            continue
    return found


def python_version() -> str:
    return platform.python_version()


def python_executable() -> str:
    return sys.executable


@dataclass(frozen=True)
class Recommendation:
    """The precision setup to train with on this machine, and why."""

    precision: str  # "bf16" | "fp16" | "fp32"
    autocast_dtype: str | None
    grad_scaler: bool
    weights_dtype: str
    summary: str
    reasons: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["reasons"] = list(self.reasons)
        return data


_NEVER_FP16_WEIGHTS = (
    "Never train with float16 weights (model.half(), torch_dtype=torch.float16): keep float32 "
    "weights and let autocast run the operations in reduced precision."
)


def recommend(report: CudaReport) -> Recommendation:
    """bf16 autocast without a scaler where every GPU has native bf16; fp16 autocast with a scaler otherwise."""
    gpus = report.gpus
    if not gpus:
        why = "no CUDA device is visible to torch" + (f" ({report.error})" if report.error else "")
        if report.build is None and report.hip is None:
            why += "; this torch build has no CUDA support"
        elif os.environ.get("CUDA_VISIBLE_DEVICES", None) is not None:
            why += f"; CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r}"
        else:
            why += f"; torch is built for CUDA {report.build or report.hip}: is the NVIDIA driver installed?"
        return Recommendation(
            precision="fp32",
            autocast_dtype=None,
            grad_scaler=False,
            weights_dtype="float32",
            summary="No GPU here: train in fp32. Run `ampguard doctor` on the training machine for its recommendation.",
            reasons=(why, _NEVER_FP16_WEIGHTS),
        )
    if all(gpu.bf16_native is None for gpu in gpus):
        native = bool(report.torch_says_bf16)
        reason = "ROCm device: torch reports bfloat16 " + ("supported" if native else "unsupported")
    else:
        native = all(gpu.bf16_native for gpu in gpus)
        slow = [gpu.label for gpu in gpus if gpu.bf16_native is False]
        reason = (
            "every GPU has native bfloat16 (compute capability 8.0 or newer)"
            if native
            else "no native bfloat16 on " + ", ".join(slow) + " (needs compute capability 8.0+; emulation is slow, "
            "whatever torch.cuda.is_bf16_supported() says)"
        )
    if native:
        return Recommendation(
            precision="bf16",
            autocast_dtype="bfloat16",
            grad_scaler=False,
            weights_dtype="float32",
            summary='bf16 autocast, no GradScaler: torch.autocast("cuda", dtype=torch.bfloat16), float32 weights.',
            reasons=(
                reason,
                "bfloat16 has float32's range: no overflow, so no loss scaling is needed.",
                _NEVER_FP16_WEIGHTS,
            ),
        )
    return Recommendation(
        precision="fp16",
        autocast_dtype="float16",
        grad_scaler=True,
        weights_dtype="float32",
        summary="fp16 autocast with a GradScaler (ampguard makes it a SafeGradScaler): "
        'torch.autocast("cuda", dtype=torch.float16), torch.amp.GradScaler("cuda"), float32 weights.',
        reasons=(
            reason,
            "float16 overflows above 65504 and underflows small gradients: loss scaling is required.",
            _NEVER_FP16_WEIGHTS,
        ),
    )
