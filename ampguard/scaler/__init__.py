"""The SafeGradScaler and everything only it uses.

* :mod:`~ampguard.scaler.safe`: the class itself, the torch-facing part (its docstring says how it stays free);
* :mod:`~ampguard.scaler.live`: the scalers in an iteration, torch's own class (a leaf others may import);
* :mod:`~ampguard.scaler.counters`: what it keeps on the host, one dataclass;
* :mod:`~ampguard.scaler.settings`: constructor arguments, defaults and environment, resolved once;
* :mod:`~ampguard.scaler.iteration`: the iteration in progress (the loss check, what step() read, the
  optimizers already unscaled);
* :mod:`~ampguard.scaler.policy`: torch's update rule replayed on the host, the floor and cap,
  collapse and stall reports;
* :mod:`~ampguard.scaler.accounting`: host mode, the counters and the mirror of the scale
  riding on torch's one read, ``stats`` and the periodic stats line;
* :mod:`~ampguard.scaler.ledger`: device mode, the counters kept on the device for fused
  optimizers, read once when a stats line is due, ``stats`` is asked for or a checkpoint is taken;
* :mod:`~ampguard.scaler.accumulation`: gradient accumulation across ``unscale_`` and ``scale()``;
* :mod:`~ampguard.scaler.crashes`: no-gradient optimizers, float16 and bfloat16 gradients,
  a second ``unscale_()``;
* :mod:`~ampguard.scaler.diagnose`: the skipped-step report (which parameters, why);
* :mod:`~ampguard.scaler.checkpoint`: ``state_dict()`` extras, ``load_state_dict()``, pickling;
* :mod:`~ampguard.scaler.sharded`: FSDP's ShardedGradScaler with this class's safety.
"""

from __future__ import annotations

from typing import Any

import ampguard.scaler.sharded as sharded
from ampguard.scaler.live import TorchGradScaler, live_scalers, params_of, scalers_in_iteration
from ampguard.scaler.policy import next_scale
from ampguard.scaler.safe import SafeGradScaler
from ampguard.scaler.settings import Settings
from ampguard.scaler.sharded import safe_sharded_scaler_class
from ampguard.stats.counters import ScalerStats

__all__ = [
    "SafeGradScaler",
    "ScalerStats",
    "TorchGradScaler",
    "live_scalers",
    "next_scale",
    "params_of",
    "safe_sharded_scaler_class",
    "scalers_in_iteration",
]

_Settings = Settings  # the name scalers pickled before the split into modules refer to


def __getattr__(name: str) -> Any:
    # ``ampguard.scaler.SafeShardedGradScaler``, the name pickle stores for FSDP's
    # scaler under ampguard: the class is made when FSDP's module is imported,
    # so unpickling in a fresh process builds it here.
    if name == "SafeShardedGradScaler":
        return sharded.pickled_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
