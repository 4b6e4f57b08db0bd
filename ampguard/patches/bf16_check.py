"""Patch ``bf16_check``: bfloat16 autocast on a GPU without native bfloat16 says so (or runs in float16).

``torch.cuda.is_bf16_supported()`` returns True on a T4 or a TITAN RTX (compute
capability 7.5) because emulated bfloat16 counts, so ``torch.autocast("cuda",
dtype=torch.bfloat16)`` runs there, far slower than float16 (cuDNN has no
bfloat16 convolution below 8.0). With this patch the first such region logs
one WARNING; ``AMPGUARD_BF16_FALLBACK=fp16`` makes such regions use float16
instead, and says that float16 needs a GradScaler.

How: ``torch.amp.autocast_mode.autocast.__init__`` is wrapped *in place*. The
class keeps its identity (dynamo recognises autocast classes by identity and
binds their signature; TorchScript by qualified name), and the wrapper keeps
the exact signature. Every spelling reaches it: ``torch.autocast``,
``torch.amp.autocast`` and the legacy ``torch.cuda.amp.autocast`` (whose
``__init__`` calls this one). The work added to an autocast region that is not
CUDA-and-enabled is one string comparison.

Inside a ``torch.compile``d function, an autocast region created there is
handled by dynamo from the call's arguments, without running ``__init__``: the
check applies to regions entered outside compiled code (the usual
``with torch.autocast(...): loss = compiled_model(x)``) and to eager code.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from ampguard.config import Config
from ampguard.errors import PatchUnavailable
from ampguard.log import logger
from ampguard.patch import Patch
from ampguard.patches.warning_attribution import attribute_past_ampguard

EXPECTED_PARAMETERS = ("self", "device_type", "dtype", "enabled", "cache_enabled")

EMULATED_BF16 = (
    'torch.autocast("cuda", dtype=torch.bfloat16) on {gpu}: this GPU has no native bfloat16 '
    "(that needs compute capability 8.0, Ampere or newer). torch emulates it, much more slowly "
    "than float16, although torch.cuda.is_bf16_supported() returns True. Use float16 autocast with "
    "a GradScaler (ampguard makes the scaler safe), or set AMPGUARD_BF16_FALLBACK=fp16 to run these "
    "regions in float16 without changing code."
)

FALLBACK_TO_FP16 = (
    "AMPGUARD_BF16_FALLBACK=fp16: bfloat16 autocast regions on {gpu}, which has no native "
    "bfloat16, run in float16 instead. float16 needs loss scaling: use a GradScaler "
    '(torch.amp.GradScaler("cuda"), which ampguard makes a SafeGradScaler) with '
    "scaler.scale(loss).backward(), scaler.step(optimizer), scaler.update(); without one, small "
    "gradients underflow to zero and overflows go unnoticed. Weights pretrained in bfloat16 can "
    "overflow float16 in the forward pass: ampguard reports that as a forward overflow."
)


def _default_cuda_dtype() -> torch.dtype:
    get = getattr(torch, "get_autocast_dtype", None)  # torch >= 2.4
    return get("cuda") if get is not None else torch.get_autocast_gpu_dtype()


class Bf16CheckPatch(Patch):
    name = "bf16_check"
    summary = "bf16 autocast on a GPU without native bf16 warns once; AMPGUARD_BF16_FALLBACK=fp16 runs it in fp16"
    requires_torch = ">=2.3"

    def __init__(self) -> None:
        super().__init__()
        self.fallback = False
        self.warned = False

    def apply(self, config: Config) -> None:
        cls = torch.amp.autocast_mode.autocast
        original = vars(cls).get("__init__")
        if original is None:
            raise PatchUnavailable("torch.amp.autocast_mode.autocast defines no __init__ of its own")
        parameters = tuple(inspect.signature(original).parameters)
        if parameters != EXPECTED_PARAMETERS:
            raise PatchUnavailable(f"autocast.__init__ takes {parameters}, expected {EXPECTED_PARAMETERS}")
        self.fallback = config.bf16_fallback == "fp16"
        self.warned = False
        self.bindings.set_attribute(cls, "__init__", _checking_init(original, self))
        # torch's warnings in __init__ ("CUDA is not available ...") name its caller, the wrapper; not so.
        attribute_past_ampguard(self.bindings, torch.amp.autocast_mode)

    def checked_dtype(self, dtype: torch.dtype | None) -> torch.dtype | None:
        """The dtype an enabled CUDA autocast region should use: ``dtype``, or float16 under the fallback."""
        try:
            requested = _default_cuda_dtype() if dtype is None else dtype
            if requested is not torch.bfloat16:
                return dtype
            import ampguard.machine as machine  # here: only a bfloat16 CUDA region needs it (~4 ms at import)

            gpu = machine.current_cuda_gpu()
        except Exception:  # whatever happens here, autocast itself decides
            return dtype
        if gpu is None or gpu.bf16_native is not False:
            return dtype
        if not self.warned:
            self.warned = True
            logger.warning((FALLBACK_TO_FP16 if self.fallback else EMULATED_BF16).format(gpu=gpu.label))
        return torch.float16 if self.fallback else dtype


def _checking_init(original: Callable[..., None], patch: Bf16CheckPatch) -> Callable[..., None]:
    @functools.wraps(original)
    def __init__(
        self: Any,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
    ) -> None:
        if device_type == "cuda" and enabled:
            dtype = patch.checked_dtype(dtype)
        original(self, device_type, dtype, enabled, cache_enabled)

    return __init__
