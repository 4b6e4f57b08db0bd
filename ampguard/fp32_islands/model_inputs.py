"""The inputs of the model's last training passes, kept until the updates that judge them.

Two things need the inputs of a forward pass that overflowed: telling a batch
that held inf/NaN (the data's fault, no module's: nothing is blamed) from a
module's overflow, and running that forward again under the probe to name the
module from this very batch (:mod:`ampguard.fp32_islands.rerun`).

Each model the headroom watch has seen (the outermost module called: the root)
gets one forward pre-hook, :class:`KeepInputs`. On every training call (autograd
on) it keeps a reference to the call's arguments and its autocast state: no
device work, no copy, no read. The passes of the last :data:`KEEP_UPDATES`
optimizer updates are kept (with gradient accumulation, every micro-batch's), so
a batch's inputs live at most that many updates longer than the training loop
keeps them. Only at a forward overflow are they looked at (one read): the data
is bad when the first model called was given NaN or +inf (-inf is an additive
mask's; a second model is fed what the first computed).

The hook has no state of its own, as an island's (:mod:`ampguard.fp32_islands.island_hooks`):
a deepcopy of the model (an EMA) carries a hook that does nothing,
:func:`strip_everywhere` takes those copies off at uninstall, and ``torch.save`` /
``torch.jit.script`` never see it (:mod:`ampguard.fp32_islands.portable`). A
compiled root gets no hook (its hooks would run inside the compiled code).
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

import ampguard.messages as messages
import ampguard.scaler.live as live
from ampguard.distributed import agree_on_skip, distributed
from ampguard.fp32_islands.island_io import autocast_dtype, autocast_enabled
from ampguard.fp32_islands.probe import is_compiled
from ampguard.fp32_islands.tensor_tree import tensors, values_in
from ampguard.log import event_logger
from ampguard.module_hooks import ModuleHook, remove_module_hooks, strip_copies
from ampguard.syncs import read_to_host
from ampguard.torch_privates import compile_context, dynamo_compiling, functorch_unwrapped, is_compiling

logger = event_logger("island")

# Optimizer updates whose inputs are kept: on a GPU with a fused optimizer the host learns of a forward overflow
# an iteration or two after it (ampguard.scaler.ledger.RowCopies).
KEEP_UPDATES = 3
# Forward passes kept per update at most (micro-batches of gradient accumulation, evaluation passes).
MAX_PASSES = 64

AUTOCAST_DEVICES = ("cuda", "cpu")
# torch's own functions where they take a device type (torch >= 2.4): no Python call of ampguard's per forward pass.
_NEW_AUTOCAST_API = getattr(torch, "get_autocast_dtype", None) is not None
_autocast_on: Callable[[str], bool] = torch.is_autocast_enabled if _NEW_AUTOCAST_API else autocast_enabled
_autocast_dtype: Callable[[str], torch.dtype] = torch.get_autocast_dtype if _NEW_AUTOCAST_API else autocast_dtype
# torch's own checks, resolved once (torch_privates.is_compiling's two; the second None if torch._guards is not
# imported yet: then that function at every call).
_dynamo_compiling = dynamo_compiling()
_compile_context = compile_context()


class Pass(NamedTuple):
    """One forward pass of a root module, as called."""

    module: weakref.ref[torch.nn.Module]
    args: Any
    kwargs: Any
    autocast: tuple[tuple[str, torch.dtype], ...]  # (device type, dtype) of each autocast region it ran in


class KeepInputs(ModuleHook):
    """Forward pre-hook (with kwargs) of a root module: its keeper notes a reference to the call's arguments.

    A copy of the hook (a deepcopy or a pickle of the model) has no keeper, and a module sharing the hook (a
    shallow copy shares its hook dict) is not the one followed: both do nothing.
    """

    def __init__(self, keeper: ModelInputs | None = None, module: torch.nn.Module | None = None) -> None:
        self.keeper = keeper
        self.module = weakref.ref(module) if module is not None else None

    def __call__(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        # (an evaluation pass is not a training batch; torch_privates.is_compiling() inlined: every forward pass)
        if not torch.is_grad_enabled() or _dynamo_compiling():
            return
        if is_compiling() if _compile_context is None else _compile_context() is not None:
            return
        keeper, followed = self.keeper, self.module
        if keeper is not None and followed is not None and followed() is module:
            keeper.note(module, args, kwargs)


def _data(tensor: torch.Tensor) -> bool:
    return (
        tensor.is_floating_point()
        and tensor.layout == torch.strided
        and tensor.device.type != "meta"
        and type(tensor) is torch.Tensor  # not a FakeTensor (a memory estimate) or another subclass
        and tensor.numel() > 0
    )


class ModelInputs:
    """The root modules' inputs of the last :data:`KEEP_UPDATES` updates.

    Example::

        inputs = ModelInputs()
        inputs.follow(sighting_roots)  # a pre-hook on each model the watch saw
        ...                            # forward passes: references kept
        inputs.nonfinite()             # at a forward overflow: True when the batch held inf/NaN (one read)
        inputs.close()                 # hooks off (uninstall)
    """

    def __init__(self) -> None:
        self._handles: dict[int, Any] = {}  # by id() of the module followed
        self._followed: dict[int, weakref.ref[torch.nn.Module]] = {}
        # One list of (args, kwargs) per update, the last one open (this update's passes so far).
        # (update count when made, its passes) per update, the last one open (this update's passes so far).
        self._cycles: deque[tuple[int, list[Pass]]] = deque(maxlen=KEEP_UPDATES + 1)
        self._refused: set[int] = set()
        self.bad_batches = 0  # forward overflows found to come from inputs holding inf/NaN
        self.broken = False  # after an error: no more keeping or judging

    def follow(self, roots: Any) -> None:
        """Keep the inputs of each module of ``roots`` (not compiled) from its next call on."""
        for root in roots:
            key = id(root)
            followed = self._followed.get(key)
            if key in self._refused or (followed is not None and followed() is root):
                continue
            if is_compiled(root) or isinstance(root, torch.jit.ScriptModule):
                self._refused.add(key)
                continue
            old = self._handles.pop(key, None)  # a dead module's, under a reused id
            if old is not None:
                old.remove()
            self._handles[key] = root.register_forward_pre_hook(KeepInputs(self, root), with_kwargs=True)
            self._followed[key] = weakref.ref(root)

    def following(self) -> list[torch.nn.Module]:
        """The live modules whose inputs are kept."""
        return [module for ref in self._followed.values() if (module := ref()) is not None]

    def note(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        begun = live.updates.count
        if not self._cycles or self._cycles[-1][0] != begun:
            self._cycles.append((begun, []))
        passes = self._cycles[-1][1]
        if len(passes) < MAX_PASSES:
            regions = []
            for device in AUTOCAST_DEVICES:  # (a loop: no generator frame at every forward pass)
                if _autocast_on(device):
                    regions.append((device, _autocast_dtype(device)))
            passes.append(Pass(weakref.ref(module), args, kwargs, tuple(regions)))

    def last_passes(self) -> list[Pass]:
        """The forward passes of the last update (its micro-batches, in order), less those a ``torch.func``
        transform ran (per-sample gradients: their inputs are functorch's wrappers, run again only inside it)."""
        last = self._last(1)
        passes = last[0] if last else []
        return [p for p in passes if not any(functorch_unwrapped(t) is not t for t in tensors((p.args, p.kwargs)))]

    def _last(self, updates: int) -> list[list[Pass]] | None:
        """The passes of each of the last ``updates`` updates begun (an update in its bookkeeping has begun: the
        passes since the one before are its own); None when some of them are no longer kept."""
        now, cycles = live.updates.count, self._cycles
        if updates > KEEP_UPDATES or (len(cycles) == cycles.maxlen and cycles[0][0] > now - updates):
            return None
        return [passes for begun, passes in cycles if now - updates <= begun < now]

    def nonfinite(self, updates: int = 1) -> bool | None:
        """Whether the first model called in each of the last ``updates`` updates was given NaN or +inf (one read).

        None: nothing kept. Training passes only (autograd on: an evaluation pass is not kept).
        """
        cycles = (self._last(updates) or []) if updates > 0 else []
        # The data as it came: the inputs of the first model called in each update (a second one, a head or a GAN's
        # discriminator, is fed what the first computed, inf where that overflowed).
        first = [[p for p in cycle if p.module() is cycle[0].module()] for cycle in cycles if cycle]
        # (inside containers of any kind, the attributes of a batch object, nested tensors, a torch.func pass's)
        leaves = [t for t in values_in([(p.args, p.kwargs) for passes in first for p in passes]) if _data(t)]
        marks = [(t.isnan() | t.isposinf()).any() for t in leaves]  # NaN or +inf: -inf is a mask's, by design
        return bool(read_to_host(torch.stack([m.to(marks[0].device) for m in marks]).any())) if marks else None

    def held_nonfinite(self, step: int, updates: int | None, collective: bool = False) -> bool:
        """At a forward overflow: whether the inputs of the last ``updates`` updates held inf/NaN, said at INFO.

        One read, after a failure only; False when not known (``updates`` None: the
        overflow is not known to be among the last updates). ``collective``: under
        torch.distributed every rank calls this at the same update (an agreed forward
        overflow) and the ranks agree (any rank's bad batch), so they make the same islands.
        """
        try:
            bad = self.nonfinite(updates) if updates and not self.broken else None
        except Exception:  # never the reason a run dies: judged as if the inputs were not kept
            logger.debug("the model's inputs could not be checked for inf/NaN", exc_info=True)
            bad = None
        if collective and distributed() is not None:
            bad = agree_on_skip(bool(bad), [])[0]
        if bad:
            self.bad_batches += 1
            logger.log(logging.INFO if self.bad_batches == 1 else logging.DEBUG, messages.BAD_BATCH.format(step=step))
        return bool(bad)

    def follow_safely(self, roots: Any) -> None:
        """:meth:`follow`, stopping for good (one WARNING) after an error."""
        if self.broken:
            return
        try:
            self.follow(roots)
        except Exception as error:  # never the reason a run dies: overflows are judged without the inputs
            self._fail(error)

    def _fail(self, error: Exception) -> None:
        self.close()
        self.broken = True
        logger.warning(
            "ampguard stopped keeping the model's inputs after an error (%r); training goes on (a batch holding "
            "inf/NaN may then be taken for a module's overflow).",
            error,
        )

    def close(self) -> None:
        """Take the hooks off (uninstall, another model); forget the inputs."""
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()
        self._followed.clear()
        self._refused.clear()
        self._cycles = deque(maxlen=KEEP_UPDATES + 1)


def strip(module: torch.nn.Module) -> None:
    """Take :class:`KeepInputs` hooks off ``module`` (those a deepcopy or a pickle carried)."""
    remove_module_hooks(module, pre=KeepInputs)


def strip_everywhere() -> None:
    """Take the hooks off every live module (copies made while a model had one): at uninstall only, after the
    keepers closed (live objects are scanned only if a copy of the hook lives)."""
    strip_copies((KeepInputs,), strip)
