"""An fp32 island of a module whose parameters are float16 or bfloat16: float32 copies for each forward call only.

A model loaded in half precision (``model.half()``, ``torch_dtype=torch.float16``)
overflows in its activations, not in its weights: the weights fit float16, and
computing the module in float32 fixes the overflow as it does for a float32 module.
So for the length of each island call, :func:`upcast` puts a float32 copy of every
half-precision parameter and floating buffer of the module and its submodules in
their place, and :func:`restore` (from the island's forward hook, which runs even
when the forward raises) puts the originals back:

* the copies are ``parameter.float()``, part of the autograd graph: the
  gradient flows back to the half-precision parameter in its own dtype (and from
  there to its float32 master, when the master_weights patch is on);
* the model's parameters keep their dtype and identity, its state dict is
  unchanged, and the optimizer steps the same Parameter objects; nothing is kept
  between calls (the copies live as long as the autograd graph that saved them);
* a half-precision buffer (a BatchNorm's running mean) is read as a float32
  copy too, and copied back into the original buffer (in its own dtype, the same
  tensor) after the call: whatever the forward pass wrote into it, in place or
  by assigning a new tensor, is kept. Always copied back, as the forward pass
  may write without a trace (BatchNorm's update of its running statistics does
  not bump the tensor's version counter); a buffer it did not change gets its own
  value back (float16 -> float32 -> float16 is exact).

Why the module's own ``_parameters`` entries are swapped, rather than calling
the module through ``torch.func.functional_call``: the island acts from hooks on
the module's own call, and functional_call would have to call the module again
from inside that call; swapping the entries changes nothing else about the call.
The module's other hooks and its submodules' hooks run as without the island,
a parameter shared by two submodules gets one float32 copy (``a.weight is b.weight``
stays true inside), a parametrization's original is swapped where it lives, and
an island inside an island finds float32 copies already there and swaps nothing.
This is what ``torch.nn.utils.stateless`` does, without its private API.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)
Swapped = list[tuple[dict[str, Any], str, torch.Tensor]]  # (a module's _parameters or _buffers, key, original)


@dataclass
class Upcast:
    """What :func:`upcast` swapped: (the module's dict, the key, the original tensor)."""

    parameters: Swapped = field(default_factory=list)
    buffers: Swapped = field(default_factory=list)


def upcast(module: torch.nn.Module) -> Upcast | None:
    """Float32 copies in place of the half-precision parameters and buffers under ``module``; None if it has none.

    On an error, whatever was swapped is put back before it propagates.
    """
    swapped = Upcast()
    copies: dict[int, torch.Tensor] = {}  # one copy per tensor: shared parameters stay shared
    try:
        for owner in module.modules():
            _swap(owner._parameters, copies, swapped.parameters)
            _swap(owner._buffers, copies, swapped.buffers)
    except BaseException:
        restore(swapped)
        raise
    return swapped if swapped.parameters or swapped.buffers else None


def _swap(entries: dict[str, Any], copies: dict[int, torch.Tensor], swapped: Swapped) -> None:
    for key, tensor in entries.items():
        # (a DeepSpeed ZeRO-3 parameter, ``ds_id``, is empty here: copied after its gather, ampguard.fp32_islands.zero3)
        if tensor is not None and tensor.dtype in LOW_PRECISION and not hasattr(tensor, "ds_id"):
            copy = copies.get(id(tensor))
            if copy is None:
                copy = copies[id(tensor)] = tensor.float()
            entries[key] = copy  # an existing key: the dict is not resized under the loop
            swapped.append((entries, key, tensor))


def low_precision_dtype(module: torch.nn.Module) -> torch.dtype | None:
    """The dtype of ``module``'s first float16/bfloat16 parameter (its submodules' included), or None."""
    for parameter in module.parameters():
        if parameter.dtype in LOW_PRECISION:
            return parameter.dtype
    return None


def restore(swapped: Upcast | None) -> None:
    """Put the originals back, each buffer with what its float32 copy holds now (in the buffer's own dtype)."""
    if swapped is None:
        return
    for parameters, key, parameter in reversed(swapped.parameters):
        parameters[key] = parameter
    written: set[int] = set()
    for buffers, key, original in reversed(swapped.buffers):
        now = buffers[key]
        buffers[key] = original
        if now is None or id(now) in written:
            continue
        written.add(id(now))
        with torch.no_grad():
            if now.shape == original.shape:
                original.copy_(now)
            else:  # assigned a tensor of another shape: kept, in the buffer's dtype
                buffers[key] = now.detach().to(original.dtype)
