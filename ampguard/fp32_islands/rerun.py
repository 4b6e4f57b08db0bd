"""At a forward overflow: the iteration's forward passes run again under the probe, to name the module at once.

Without this, the probe arms at a forward overflow and names the module at the
next one: a sudden overflow cost two batches. The inputs of the overflowing
iteration are kept (:mod:`ampguard.fp32_islands.model_inputs`); at its update
the model runs again on them, without autograd, under the autocast it ran in,
with the probe armed (:mod:`ampguard.fp32_islands.probe`). The probe's verdict
(one read) names the module, and its island is in place before the next batch.

What the forward changes is put back, so the run goes on as if it had not run
again: the random number generators (:func:`torch.random.fork_rng`: the next
batch's dropout draws as it would have), every buffer of the model (BatchNorm's
running statistics, step counters) and the plain-number attributes of its
modules (a Python call counter). A forward that cannot be repeated safely is
not run again, and the probe arms as before (said once at INFO): an input that
is an iterator or a generator (the forward consumes it), a sharded model (FSDP,
DeepSpeed: its forward gathers parameters with the other ranks), no kept input.
``AMPGUARD_FORWARD_RERUN=off`` declares a model's forward not repeatable
(it changes state ampguard cannot see: a cache outside the model, a counter in
another object).

A DDP or DataParallel wrapper is not called again: the model inside it is (their
forward adds no computation, and DDP's would talk to the other ranks).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ampguard.distributed import agree_on_skip, distributed
from ampguard.fp32_islands.model_inputs import Pass
from ampguard.fp32_islands.probe import Call, Probe
from ampguard.syncs import read_to_host

# Wrappers whose forward adds no computation: the model inside is called instead.
PLAIN_WRAPPERS = {"DistributedDataParallel": "module", "DataParallel": "module"}
# Models whose forward gathers sharded parameters with the other ranks: not run again.
SHARDED = ("FullyShardedDataParallel", "FSDPModule", "DeepSpeedEngine")
NUMBERS = (int, float, bool)


def why_not(passes: list[Pass]) -> str | None:
    """Why these forward passes cannot be run again safely; None when they can."""
    if not passes:
        return "no forward pass of the model was kept (a compiled model, or called before the first watch)"
    for kept in passes:
        model = kept.module()
        if model is None:
            return "the model was freed"
        if any(cls.__name__ in SHARDED for module in model.modules() for cls in type(module).__mro__):
            return "the model is sharded (FSDP, DeepSpeed): its forward gathers parameters with the other ranks"
        if _consumable(kept.args) or _consumable(kept.kwargs.values()):
            return "an input is an iterator or a generator, which the forward consumed"
    return None


def _consumable(values: Iterable[Any], depth: int = 2) -> bool:
    for value in values:
        if isinstance(value, Iterator):
            return True
        if depth and isinstance(value, (list, tuple)):
            if _consumable(value, depth - 1):
                return True
        elif depth and isinstance(value, dict) and _consumable(value.values(), depth - 1):
            return True
    return False


def run_again(passes: list[Pass], probe: Probe) -> torch.Tensor | None:
    """Run ``passes`` again under the armed ``probe``, state put back; the probe's verdict (a device scalar).

    The caller arms the probe before and reads the verdict after
    (:meth:`~ampguard.fp32_islands.probe.Probe.call`); exceptions of the model's
    forward propagate (the caller falls back to the probe).
    """
    for kept in passes:
        model = kept.module()
        if model is None:
            continue
        inner = model
        while type(inner).__name__ in PLAIN_WRAPPERS:
            inner = getattr(inner, PLAIN_WRAPPERS[type(inner).__name__])
        # Its warnings were the first run's to show (and a checkpointed block warns that no input requires grad).
        with _state_put_back(inner), torch.no_grad(), _autocast(kept.autocast), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            inner(*kept.args, **kept.kwargs)
    return probe.verdict


@contextlib.contextmanager
def _autocast(regions: tuple[tuple[str, torch.dtype], ...]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for device_type, dtype in regions:
            stack.enter_context(torch.autocast(device_type, dtype=dtype))
        yield


@contextlib.contextmanager
def _state_put_back(model: torch.nn.Module) -> Iterator[None]:
    """The model's buffers, its modules' plain-number attributes and the RNG streams, as before the block."""
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    numbers = [
        (module, name, value)
        for module in model.modules()
        for name, value in vars(module).items()
        if type(value) in NUMBERS
    ]
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        with torch.no_grad():
            for buffer, copy in buffers:
                buffer.copy_(copy)
        for module, name, value in numbers:
            if vars(module).get(name) is not value:
                setattr(module, name, value)


def find(passes: list[Pass], probe: Probe, collective: bool) -> tuple[Call | None, str | None]:
    """The module call that overflowed in ``passes`` run again (None: none found), and why they were not run.

    One read (the verdict). ``collective``: under torch.distributed every rank
    calls this at the same update, and the ranks agree on the verdict (the
    largest), as on the probe's.
    """
    reason = why_not(passes)
    index = 0
    probe.arm()
    try:
        if reason is None:
            try:
                verdict = run_again(passes, probe)
                index = int(read_to_host(verdict.reshape(1))[0]) if verdict is not None else 0
            except Exception as error:  # the model's forward, or ampguard's: the probe arms as before
                reason = f"running it again raised {type(error).__name__}: {error}"
        if collective and distributed() is not None:
            index = agree_on_skip(False, [index])[1][0]
        return probe.call(index), reason
    finally:
        probe.disarm()
