"""Whether the ranks of a torch.distributed job train one model together, and what they agree on.

Only ranks that train one model (DDP, FSDP) skip the same steps, so only then
may a skipped step exchange "was a loss inf/NaN on any rank" and the
listeners' fields between the ranks (:func:`agree_on_skip`), and a step the
underflow patch sampled (at the same optimizer steps on every rank) its
totals (:func:`agree_on_underflow`); healthy steps never exchange anything.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ampguard.live_objects import instances
from ampguard.log import logger
from ampguard.syncs import read_to_host


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

    Looked up once, at the first skipped or underflow-sampled step (a scan of
    live objects: never on a healthy step), and kept for the process.
    """
    global _shared_gradients
    if _shared_gradients is None:
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
        _shared_gradients = bool(wrappers) and bool(instances(*wrappers))
    return _shared_gradients


_last_exchange: torch.Tensor | None = None
_exchange_failed = False


def agree_on_skip(loss_nonfinite: bool, fields: list[int]) -> tuple[bool, list[int]]:
    """On a skipped step: whether a loss was inf/NaN on any rank, and each field's largest value on any rank.

    One all-reduce (MAX) when the ranks train one model (:func:`distributed`);
    the local values otherwise, or when the exchange fails (said once).
    """
    global _last_exchange, _exchange_failed
    dist = distributed()
    if dist is None:
        return loss_nonfinite, fields
    try:
        values = torch.tensor([float(loss_nonfinite), *map(float, fields)], device=_backend_device(dist))
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        agreed = read_to_host(values)
        # Kept until the next exchange: a gloo thread must never free this tensor's Python object, which
        # takes the GIL and, on torch < 2.8, can deadlock a process group destroyed at exit (examples/ddp_train.py).
        _last_exchange = values
    except Exception as error:
        if not _exchange_failed:
            _exchange_failed = True
            logger.warning("ampguard could not exchange a skipped step's verdict between ranks (%r).", error)
        return loss_nonfinite, fields
    return bool(agreed[0]), [int(value) for value in agreed[1:]]


def _backend_device(dist: Any) -> torch.device:
    """Where the backend's collectives run: NCCL the current CUDA device, gloo (and the rest) the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


_last_totals: tuple[torch.Tensor, ...] = ()
_totals_failed = False


def agree_on_underflow(totals: torch.Tensor) -> torch.Tensor | None:
    """On an underflow-sampled step: the ranks' totals together (``[values, zeros, low, below_normal, sunk, energy,
    peak]``).

    Two all-reduces on the backend's device, SUM of the counts and the energy and MAX of
    the peak, when the ranks train one model (:func:`distributed`); every rank
    calls it on the same step with a tensor of the same size (zeros where it
    counted nothing). ``totals`` as it is alone, and None when the exchange
    fails (said once): the caller then only reports that sample. No read: the
    result stays on the device.
    """
    global _last_totals, _totals_failed
    dist = distributed()
    if dist is None:
        return totals
    try:
        device = _backend_device(dist)
        counts = totals[:-1].to(device, torch.float64, copy=True)
        peak = totals[-1:].to(device, torch.float64, copy=True)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        _last_totals = (counts, peak)  # kept until the next exchange (see agree_on_skip)
    except Exception as error:
        if not _totals_failed:
            _totals_failed = True
            logger.warning(
                "ampguard could not exchange a sampled step's underflow between ranks (%r); "
                "the scale is not grown for that sample.",
                error,
            )
        return None
    return torch.cat([counts, peak])
