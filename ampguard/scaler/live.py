"""Which SafeGradScalers are in an iteration (scaled a loss since their last update), and torch's own class.

A leaf module: the clip patch and the scaler's own modules read these without importing the scaler class.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ampguard.scaler.safe import SafeGradScaler

TorchGradScaler = torch.amp.grad_scaler.GradScaler  # torch's class, whatever names point to later

# Scalers that scaled a loss since their last update(); the clip patch reads it
# through live_scalers().
scalers_in_iteration: weakref.WeakSet[SafeGradScaler] = weakref.WeakSet()


class Updates:
    """How many optimizer updates began in this process (a SafeGradScaler's ``update()``, a DeepSpeed fp16 step):
    the iterations' boundaries, for data kept per iteration by code that does not hear every update (the inputs
    fp32 islands keep). A count, bumped with no call."""

    count = 0


updates = Updates()


def live_scalers() -> list[SafeGradScaler]:
    """The scalers in :data:`scalers_in_iteration`, safe while other threads add or discard some.

    Iterating a WeakSet that another thread changes raises "Set changed size
    during iteration"; copying its set of references is one C call under the GIL.
    """
    refs = scalers_in_iteration.data.copy()  # type: ignore[attr-defined]  # WeakSet's set of references
    alive = [ref() for ref in refs]
    return [scaler for scaler in alive if scaler is not None]


def params_of(optimizers: Iterable[Any]) -> set[int]:
    """ids of every parameter the optimizers hold."""
    return {id(p) for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]}
