"""The SafeGradScaler and everything only it uses.

* :mod:`~ampguard.scaler.safe`: the class itself, the torch-facing part (its docstring says how it stays free);
  it is one object made of parts, one class per file: :mod:`~ampguard.scaler.policy` (ScalePolicy: the rule,
  floor, cap, the one counting path), :mod:`~ampguard.scaler.ledger` (DeviceBooks: device mode, the ledger's rows and their host copies),
  :mod:`~ampguard.scaler.accounting` (HostBooks: host mode, ``stats``), :mod:`~ampguard.scaler.checkpoint`
  (Checkpoints), :mod:`~ampguard.scaler.crashes` (CrashGuards), :mod:`~ampguard.scaler.accumulation`
  (Accumulation); :mod:`~ampguard.scaler.parts` declares the state they share;
* :mod:`~ampguard.scaler.verdict`: StepVerdict, what one update decided;
* :mod:`~ampguard.scaler.live`: the scalers in an iteration, the count of updates begun, torch's own class
  (a leaf others may import);
* :mod:`~ampguard.scaler.counters`: what it keeps on the host, one dataclass;
* :mod:`~ampguard.scaler.settings`: constructor arguments, defaults and environment, resolved once;
* :mod:`~ampguard.scaler.iteration`: the iteration in progress (the loss check, what step() read, the
  optimizers already unscaled);
* :mod:`~ampguard.scaler.listeners`: the capabilities that hear of its steps, and which of them a step concerns;
* :mod:`~ampguard.scaler.view`: ScalerView, what a capability may read of it;
* :mod:`~ampguard.scaler.handle`: ScalerHandle, what a capability holds of it (the listeners' argument);
* :mod:`~ampguard.scaler.diagnose`: the skipped-step report (which parameters, why);
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
