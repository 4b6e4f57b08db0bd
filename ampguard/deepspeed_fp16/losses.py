"""Forward overflows under DeepSpeed fp16: the losses since the last step, and the verdict handed to fp32 islands.

DeepSpeed decides one thing per optimizer step, overflow, from the gradients;
a loss that was itself inf/NaN (a *forward* overflow: a block whose float16
activations passed 65504) is not told apart. ampguard's fp32 islands need
exactly that distinction, so ``DeepSpeedEngine.backward`` keeps a reference to
each loss it is given (no device work, no copy: :func:`engine_backward`), and
at a step DeepSpeed found an overflow in, one host read says whether a loss was
inf/NaN (:func:`forward_overflow`; agreed between ranks with one all-reduce
under torch.distributed). A healthy step reads nothing: the references are
dropped.

The verdict is counted (``nonfinite_loss``) and reaches whoever listens to
loss-scale steps (the fp32_islands patch's listener) through
:func:`ampguard.scaler.listeners.notify_foreign_step` (ampguard.deepspeed_fp16.hooks),
as a SafeGradScaler's forward overflows reach it through ``on_update``.
``DeepSpeedEngine.scale(loss)`` is kept the same way: DeepSpeed's torch-style
backward, ``engine.scale(loss).backward()``, is its only direct backward that
works with an fp16 loss scale (a bare ``loss.backward()`` raises in DeepSpeed
itself: ZeRO 0 refuses direct backward calls, ZeRO 1-3 an unscaled loss).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

import ampguard.containment as containment
from ampguard.deepspeed_fp16.tracking import Policy
from ampguard.syncs import read_to_host

# Losses of more micro-batches than this between two steps (a loop that never steps): the oldest are dropped.
MAX_KEPT = 256

_lock = threading.Lock()
# Per engine, the losses since its last step: another engine's (two models trained side by side) are not this one's.
_kept: weakref.WeakKeyDictionary[Any, list[torch.Tensor]] = weakref.WeakKeyDictionary()


def engine_backward(original: Callable[..., Any], policy: Policy) -> Callable[..., Any]:
    """``DeepSpeedEngine.backward`` and ``DeepSpeedEngine.scale``: the loss is kept (a detached reference), then
    DeepSpeed's method runs."""

    def backward(self: Any, loss: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            if isinstance(loss, torch.Tensor) and loss.is_floating_point():
                with _lock:
                    kept = _kept.setdefault(self, [])
                    kept.append(loss.detach())
                    del kept[:-MAX_KEPT]
        except Exception as error:  # never the reason a run dies
            containment.report("deepspeed_fp16 backward", error)
        return original(self, loss, *args, **kwargs)

    return backward


def _owns(engine: Any, owner: Any) -> bool:
    """Whether ``owner`` (an fp16 optimizer at ZeRO 0, a loss scaler at ZeRO 1-3) steps ``engine``."""
    optimizer = getattr(engine, "optimizer", None)
    return optimizer is owner or getattr(optimizer, "loss_scaler", None) is owner


def steps_fp16(owner: Any) -> bool:
    """Whether ``owner`` (a loss scaler) steps an engine that trains in float16 (a bf16 engine's scaler is a static
    1, left alone); an owner no engine is known to hold (no backward through an engine yet): False."""
    with _lock:
        engines = [engine for engine in list(_kept.keys()) if _owns(engine, owner)]
    return any(bool(getattr(engine, "fp16_enabled", lambda: False)()) for engine in engines)


def forward_overflow(overflow: bool, owner: Any) -> bool:
    """Whether this step's overflow was a forward one (a loss of ``owner``'s engine inf/NaN); that engine's kept
    losses are forgotten.

    ``overflow``: DeepSpeed's verdict for the step, agreed between ranks. ``owner``: the fp16 optimizer (ZeRO 0) or
    the loss scaler (ZeRO 1-3) whose step this is; an owner no engine is known to hold takes every engine's losses.
    Reads the host only when ``overflow`` is True.
    """
    with _lock:
        engines = [engine for engine in list(_kept.keys()) if _owns(engine, owner)] or list(_kept.keys())
        kept = [loss for engine in engines for loss in _kept[engine]]
        for engine in engines:  # (the engine stays known, with nothing kept: its owner finds it next time)
            _kept[engine] = []
    if not overflow:
        return False
    flag = torch.zeros((), dtype=torch.float32)
    if kept:  # (DeepSpeed takes scalar losses only)
        flag = (~torch.stack([loss.float().sum().to(kept[-1].device) for loss in kept]).isfinite()).any().float()
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = _on_collective_device(flag)  # every rank is here: DeepSpeed's overflow verdict is agreed
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(read_to_host(flag.reshape(1))[0] > 0)


def _on_collective_device(flag: torch.Tensor) -> torch.Tensor:
    backend = str(torch.distributed.get_backend())
    if backend == "nccl" and flag.device.type != "cuda":
        return flag.cuda()
    if backend == "gloo" and flag.device.type != "cpu":
        return flag.cpu()
    return flag
