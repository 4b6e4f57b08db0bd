"""Whether the ranks of a torch.distributed job train one model together (and so skip the same steps).

Only then may the forward-overflow healing exchange its verdict between ranks on a skipped step.
"""

from __future__ import annotations

import sys
from typing import Any


def distributed() -> Any:
    """torch.distributed when ranks train one model together and so skip the same steps, else None.

    Only then is the exchange on a skipped step safe: ranks that train models of
    their own (or pipeline stages) skip different steps, and a collective called
    by some ranks only would hang the job.
    """
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return dist if ranks_share_gradients() else None
    except Exception:
        pass
    return None


_shared_gradients: bool | None = None


def ranks_share_gradients() -> bool:
    """Whether a DDP, FSDP or FSDP2 module exists in this process: its gradients are all-reduced across ranks.

    Looked up once, at the first skipped step (a scan of live objects: a cost
    after a failure only, never on a healthy step), and kept for the process.
    """
    global _shared_gradients
    if _shared_gradients is None:
        import gc

        wrappers = tuple(
            cls
            for module_name, name in (
                ("torch.nn.parallel", "DistributedDataParallel"),
                ("torch.distributed.fsdp", "FullyShardedDataParallel"),
                ("torch.distributed.fsdp", "FSDPModule"),
                ("torch.distributed._composable.fsdp", "FSDPModule"),
            )
            if isinstance(cls := getattr(sys.modules.get(module_name), name, None), type)
        )
        _shared_gradients = bool(wrappers) and any(isinstance(obj, wrappers) for obj in gc.get_objects())
    return _shared_gradients
