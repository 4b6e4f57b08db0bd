"""FSDP's ``ShardedGradScaler`` with SafeGradScaler's safety, made on demand (one class per ShardedGradScaler).

Its update rule differs from the one ``next_scale`` replays (found_inf is
all-reduced across ranks), so it always keeps its bookkeeping on the device
(:mod:`ampguard.scaler.ledger`). Pickle stores it as
``ampguard.scaler.SafeShardedGradScaler``; that name builds the class in a fresh
process (the package's ``__getattr__`` calls :func:`pickled_class`).
"""

from __future__ import annotations

import importlib
from typing import Any

from ampguard.scaler.settings import active_settings

_sharded_classes: dict[type, type] = {}
_DEFAULT_GROUP = object()


def safe_sharded_scaler_class(sharded: Any) -> type:
    """A subclass of FSDP's ``ShardedGradScaler`` with SafeGradScaler's safety (one per class)."""
    if sharded in _sharded_classes:
        return _sharded_classes[sharded]
    from ampguard.scaler.safe import SafeGradScaler

    class SafeShardedGradScaler(SafeGradScaler, sharded):  # type: ignore[misc]
        """FSDP's ``ShardedGradScaler`` under ampguard: its cross-rank found_inf all-reduce, SafeGradScaler's safety."""

        _host_mirror_exact = False
        _unscale_grads_ = sharded._unscale_grads_

        def __init__(
            self,
            device: str = "cuda",
            init_scale: float | None = None,
            backoff_factor: float = 0.5,
            growth_factor: float = 2.0,
            growth_interval: int | None = None,
            enabled: bool = True,
            process_group: Any = _DEFAULT_GROUP,
            *,
            min_scale: float | None = None,
            max_scale: float | None = None,
        ) -> None:
            settings = active_settings(init_scale, growth_interval, min_scale, max_scale)
            extra = {} if process_group is _DEFAULT_GROUP else {"process_group": process_group}
            sharded.__init__(
                self,
                device,
                init_scale=settings.init_scale,
                backoff_factor=backoff_factor,
                growth_factor=growth_factor,
                growth_interval=settings.growth_interval,
                enabled=enabled,
                **extra,
            )
            self._ampguard_setup(settings)

    SafeShardedGradScaler.__name__ = "ShardedGradScaler"
    # Found by pickle (torch.save of the scaler object) through ampguard.scaler's __getattr__.
    SafeShardedGradScaler.__module__ = "ampguard.scaler"
    SafeShardedGradScaler.__qualname__ = "SafeShardedGradScaler"
    _sharded_classes[sharded] = SafeShardedGradScaler
    return SafeShardedGradScaler


def pickled_class() -> type:
    """``ampguard.scaler.SafeShardedGradScaler``: the class is made when FSDP's module is imported (patched)."""
    sharded = importlib.import_module("torch.distributed.fsdp.sharded_grad_scaler").ShardedGradScaler
    return sharded if is_safe_sharded(sharded) else safe_sharded_scaler_class(sharded)


def is_safe_sharded(cls: Any) -> bool:
    """Whether ``cls`` is a class :func:`safe_sharded_scaler_class` made (FSDP's scaler patched already)."""
    return cls in _sharded_classes.values()
