"""The two hooks of an fp32 island, and the table of islands they serve, keyed by module instance.

The hooks are small callable objects holding only the :class:`IslandTable` of
the patch's application that made them: each call looks its island up there by
the module it is called on. So a model holding them can be saved whole
(``torch.save(model)`` pickles its hooks) and copied (``copy.deepcopy``: an EMA
or a mean teacher): a copied or unpickled hook holds no table, and a hook whose
module is not an island (a copy, a model loaded from such a file, ampguard
uninstalled) does nothing. :func:`strip` takes them off a module they were copied onto.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

import ampguard.fp32_islands.half_parameters as half_parameters
import ampguard.fp32_islands.island_io as island_io
import ampguard.fp32_islands.zero3 as zero3
from ampguard.fp32_islands.tensor_tree import tensors
from ampguard.log import event_logger
from ampguard.module_hooks import ModuleHook, remove_module_hooks, strip_copies
from ampguard.torch_privates import is_compiling

logger = event_logger("island")

# Said once per island at INFO when a call's inputs hide half precision where no cast reaches.
HIDDEN_HALF_INPUTS = (
    "fp32 island %s steps aside for calls whose inputs hold a float16/bfloat16 tensor inside an object ampguard "
    "cannot cast (the attributes of a plain class): they run as without the island, in autocast's dtypes. Pass "
    "such inputs in a tuple, dict, dataclass or a registered pytree type for the island to take them."
)


@dataclass
class Island:
    name: str  # qualified from the top-level module: for messages and checkpoints only
    module: weakref.ref[torch.nn.Module]
    handles: list[Any] = field(default_factory=list)
    # The dtypes its floating outputs had under autocast (ampguard.fp32_islands.island_io.output_kinds); None: not known.
    outputs: tuple[str, ...] | None = None
    # It overflowed again in float32 (the probe named it again): said once.
    unhelpful_reported: bool = False


class IslandTable:
    """The islands of one application of the fp32_islands patch, by id() of their module: what their hooks read.

    An entry whose module is dead (or whose id was reused) is no island.
    """

    def __init__(self) -> None:
        self.by_module: dict[int, Island] = {}
        self._stepped_aside: set[str] = set()  # the islands said to step aside for hidden half-precision inputs
        self._fallback_warned = False

    def of(self, module: torch.nn.Module) -> Island | None:
        """``module``'s island, or None."""
        island = self.by_module.get(id(module))
        return island if island is not None and island.module() is module else None

    def step_aside_hidden(self, module: torch.nn.Module) -> None:
        """Once per island: its call ran as without the island (torch's dtypes), its inputs hiding half precision."""
        island = self.of(module)
        name = island.name if island is not None else type(module).__name__
        if name not in self._stepped_aside:
            self._stepped_aside.add(name)
            logger.info(HIDDEN_HALF_INPUTS, name)

    def warn_fallback(self, error: Exception) -> None:
        if not self._fallback_warned:
            self._fallback_warned = True
            logger.warning(
                "an fp32 island could not run in float32 (%s: %s); it runs under autocast as before.",
                type(error).__name__,
                error,
            )


def device_type_of(module: torch.nn.Module, args: Any) -> str:
    for tensor in module.parameters():
        return tensor.device.type
    for value in tensors(args):
        return value.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


# Per thread, the island calls in progress: (module, autocast region left or None, autocast's dtype outside,
# the float32 copies of its half-precision parameters and buffers or None).
_regions = threading.local()


class EnterFloat32(ModuleHook):
    """Forward pre-hook (with kwargs): float32 inputs, parameters and buffers, autocast off, for an island.

    Under autocast: autocast off inside, the floating inputs cast as ``custom_fwd(cast_inputs=torch.float32)``
    casts them. Without autocast, in a model stored in float16/bfloat16 (``model.half()``, DeepSpeed's fp16 mode):
    the half-precision inputs cast to float32 (:func:`~ampguard.fp32_islands.island_io.half_inputs_to_float32`).
    Either way the half-precision parameters and buffers are read as float32 copies for the call.
    """

    def __init__(self, table: IslandTable | None = None) -> None:
        self.table = table  # None in a copy or an unpickled model: the hook does nothing

    def __call__(self, module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
        if is_compiling():  # dynamo traces the hook: nothing of it goes into compiled code (fullgraph included)
            return None
        table = self.table
        if table is None or table.of(module) is None:
            return None
        stack = _regions.__dict__.setdefault("stack", [])
        try:
            device_type = device_type_of(module, args)
            if not island_io.autocast_enabled(device_type):
                return self._without_autocast(table, module, args, kwargs, stack)
            outside = island_io.autocast_dtype(device_type)
            cast = island_io.inputs_to_float32(args, device_type), island_io.inputs_to_float32(kwargs, device_type)
            if island_io.hides_half_inputs(cast, device_type):  # float16 kept inside an object: it would meet
                stack.append((module, None, None, None))  # float32 weights and raise in the user's forward
                table.step_aside_hidden(module)
                return None
            region = torch.autocast(device_type, enabled=False)
            upcast = half_parameters.upcast(module)
            try:
                region.__enter__()  # last: whatever raised before it leaves no region open
            except BaseException:
                half_parameters.restore(upcast)
                raise
            stack.append((module, region, outside, upcast))
            return cast
        except Exception as error:  # never the reason a run dies: this call runs as without the island
            stack.append((module, None, None, None))
            table.warn_fallback(error)
            return None

    @staticmethod
    def _without_autocast(table: IslandTable, module: torch.nn.Module, args: Any, kwargs: Any, stack: list[Any]) -> Any:
        """A half-precision module or half-precision inputs without autocast: float32 inside, nothing to leave.

        A call with nothing in half precision (a float32 model without autocast) runs as it is.
        """
        own = half_parameters.low_precision_dtype(module) or island_io.low_precision_dtype((args, kwargs))
        if own is None:
            stack.append((module, None, None, None))
            return None
        cast = island_io.half_inputs_to_float32(args), island_io.half_inputs_to_float32(kwargs)
        if island_io.hides_half_inputs(cast, None):
            stack.append((module, None, None, None))
            table.step_aside_hidden(module)
            return None
        stack.append((module, _NO_REGION, own, half_parameters.upcast(module)))
        return cast


class _NoRegion:
    """The "region" of an island call without autocast: nothing to enter or leave."""

    def __exit__(self, *exc: object) -> None:
        return None


_NO_REGION = _NoRegion()


class LeaveFloat32(ModuleHook):
    """Forward hook (``always_call``): leaves what :class:`EnterFloat32` entered, outputs in their dtypes."""

    def __init__(self, table: IslandTable | None = None) -> None:
        self.table = table  # None in a copy or an unpickled model: the hook does nothing

    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        if is_compiling():
            return None
        stack = _regions.__dict__.get("stack")
        if not stack or stack[-1][0] is not module:  # this call never entered (not an island, a pre-hook raised)
            return None
        _, region, outside, upcast = stack.pop()
        if region is None:
            return None
        try:
            try:
                region.__exit__(None, None, None)
            finally:
                half_parameters.restore(upcast)
            island = self.table.of(module) if self.table is not None else None
            if output is None or island is None:
                return None
            if region is _NO_REGION:  # ``outside``: the half-precision dtype the call came in with
                return island_io.outputs_without_autocast(output, island.outputs, outside)
            if island.outputs is not None:
                return island_io.outputs_as_recorded(output, island.outputs, outside)
        except Exception as error:
            if self.table is not None:
                self.table.warn_fallback(error)
        return None


def attach(module: torch.nn.Module, island: Island, table: IslandTable) -> None:
    """Give ``module`` the hooks of ``table``'s island ``island`` (any copied onto it before are taken off first)."""
    strip(module)
    # First of the pre-hooks: those that compute a weight from parameters (old-style weight_norm, spectral_norm,
    # prune) then compute it from the float32 copies of a half-precision module's parameters.
    island.handles.append(module.register_forward_pre_hook(EnterFloat32(table), prepend=True, with_kwargs=True))
    # First of the module's forward hooks, as if its forward were wrapped: the others see the caller's dtypes.
    island.handles.append(module.register_forward_hook(LeaveFloat32(table), prepend=True, always_call=True))
    island.handles.extend(zero3.attach(module))  # DeepSpeed ZeRO-3: copies made after each gather


def strip(module: torch.nn.Module) -> bool:
    """Take island hooks off ``module`` (those a deepcopy or a pickle carried too). True if it had any."""
    found = remove_module_hooks(module, pre=EnterFloat32, post=LeaveFloat32)
    return zero3.strip(module) or found


def strip_everywhere() -> None:
    """Take island hooks off every live module (copies of a model made while it had islands): at uninstall only,
    after the islands' own hooks were removed by their handles (live objects are scanned only if a copy lives)."""
    strip_copies((EnterFloat32, LeaveFloat32, zero3.GatheredToFloat32, zero3.ReleaseFloat32), strip)
