"""The headroom watch: how close each module's float16 tensors come to 65,504, seen before they overflow.

Every ``AMPGUARD_WATCH_EVERY`` optimizer steps, one iteration's forward passes
are observed (:class:`HeadroomWatch`): two global module hooks keep the stack
of module calls, and while the model runs a ``TorchDispatchMode`` sees every
aten op's output, so the intermediates no module returns are seen too (the
attention logits ``q @ k.T`` inside an attention's ``forward``, and those
inside ``F.multi_head_attention_forward``, which a ``TorchFunctionMode`` sees
as one call). Each float16 output's minimum and maximum (one ``aminmax`` on
the device) is attributed to the innermost module running. Nothing is read on
the host during the pass.

At the end of the iteration (the scaler's ``step()``) the samples become a
:class:`Sighting`: one float32 peak per module on the device, and the
verdict: ``index + 1`` of the module with the highest peak when that peak is
within ``AMPGUARD_HEADROOM`` of float16's limit, else 0. The verdict rides on
the scaler's one host read, as the probe's does (the two never run in the same
iteration); :mod:`ampguard.fp32_islands.watch_verdicts` makes the island. The
verdict and the few highest peaks are also copied to the host without waiting
(:class:`~ampguard.syncs.HostCopy`), before the read the scaler makes next, so that naming the
island, blaming a module at a forward overflow (the one the last watch saw
closest, when its peak was within :data:`BLAME_BOUND` of the limit), device
mode's verdict and ``scaler.stats`` read nothing more.

A peak counts finite values only (a tensor holding +inf counts as 0: that
overflow is the probe's to find). A negative extreme within 1/16 of float16's
lowest (-61,410 to -65,504, or -inf) is taken for an attention mask
(``finfo(float16).min`` added to logits), not for a growing activation, and is
not counted. The root module (the outermost module called) and islands are
not candidates: the root's own code is never islanded, and an island computes
in float32.

The mode is entered with the model (the root, or the module inside a DDP /
FSDP / ... wrapper: :func:`~ampguard.fp32_islands.probe.unwrap`) and left with
it, so a wrapper's own code runs outside it: every tensor an op makes under a
Python dispatch mode gets a Python object, and a DDP wrapper's forward
rebuilds its gradient buckets at the second iteration (the one watched). A
gloo worker thread that later frees such a bucket must take the GIL, and on
torch < 2.8 a process group destroyed meanwhile holds it while joining that
thread: the job hung at exit (docs/distributed.md). The model's own code stays
inside: dynamo does not run compiled code under a dispatch mode, so a
submodule compiled in place (``model.encoder.compile()``) that the model
calls runs eagerly on the watched step; outside the mode dynamo would trace
the watch's global hooks, and their handles, new at each watched step, made it
compile again each time until its recompile limit, after which it never ran
compiled again.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.modules import module as nn_module

import ampguard.fp32_islands.islands as islands
from ampguard.fp32_islands.island_io import output_kinds
from ampguard.fp32_islands.probe import MAX_CALLS, is_compiled, qualified_name, unwrap
from ampguard.fp32_islands.tensor_tree import tensors
from ampguard.log import event_logger
from ampguard.syncs import HostCopy
from ampguard.torch_privates import is_compiling

logger = event_logger("island")

try:
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # a torch that moved it: the watch reports itself unavailable
    TorchDispatchMode = None  # type: ignore[assignment, misc]

FLOAT16_MAX = 65504.0
# A negative extreme this close to float16's lowest is a mask (finfo.min added to logits, -inf), not growth.
MASK_BAND = FLOAT16_MAX * 15 / 16
# At a forward overflow with no warning, the module the last watch saw closest is blamed at once when its peak was
# within this factor of float16's limit (6 bits: 1,024 and up). An input 8x louder than usual multiplies attention
# logits (a product of two projections of it) by 64: a module that far from the limit can overflow on one batch;
# healthy activations (normalised, a few units to a few hundred) stay below it.
BLAME_BOUND = 64.0
# How many of the tightest modules scaler.stats shows.
SHOWN = 3
# Outermost module calls watched per iteration at most (micro-batches of gradient accumulation, a GAN's models): an
# evaluation loop run under autocast before the next step() is watched no further, in time or memory.
MAX_PASSES = 64


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread (checkpointing recomputes there)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


@dataclass
class Sighting:
    """One watched iteration: the candidates' peaks and the verdict, on the device (and on its way to the host)."""

    modules: list[tuple[weakref.ref[torch.nn.Module], weakref.ref[torch.nn.Module]]]  # (module, its root)
    outputs: list[tuple[str, ...] | None]  # each candidate's output dtypes under autocast (for its island)
    verdict: torch.Tensor  # float32 scalar: index + 1 of the candidate within the headroom, 0 when none
    # [verdict, 1 if a watched float16 tensor held NaN or +inf, the SHOWN highest peaks, their indices]
    summary: HostCopy
    step: int = 0  # the optimizer step whose forward passes were watched
    clean: bool = False  # its iteration had no forward overflow (set at its update)
    blamed: bool = False  # a forward overflow was blamed on what it saw (once per sighting)
    shown: tuple[tuple[str, float], ...] | None = None  # the tightest candidates, named, for scaler.stats
    overflowed: bool = False  # its pass held an overflow (known in device mode, where one read covers many steps)
    top: list[tuple[int, float]] = field(default_factory=list)  # (index, peak) of the tightest candidates

    def candidate(self, index: int) -> tuple[torch.nn.Module, torch.nn.Module, tuple[str, ...] | None] | None:
        """The ``index``-th candidate (0-based) while its module lives."""
        if not 0 <= index < len(self.modules):
            return None
        module, root = (ref() for ref in self.modules[index])
        return None if module is None or root is None else (module, root, self.outputs[index])

    def tightest(self) -> tuple[tuple[str, float], ...]:
        """The candidates with the highest peaks, named from their root (no read: see :class:`~ampguard.syncs.HostCopy`)."""
        if self.shown is None:
            self.read_verdict()
        return self.shown or ()

    def read_verdict(self) -> int:
        """The verdict, with the tightest candidates' peaks, from the host copy."""
        read = self.summary.values()
        count = (len(read) - 2) // 2
        self.overflowed = bool(read[1])
        self.top = [(int(index), float(peak)) for peak, index in zip(read[2 : 2 + count], read[2 + count :])]
        shown = []
        for index, peak in self.top:
            found = self.candidate(index)
            name = qualified_name(found[0], found[1]) if found is not None else None
            if name:
                shown.append((name, float(peak)))
        self.shown = tuple(shown)
        return int(read[0])


@dataclass
class _Slot:
    module: weakref.ref[torch.nn.Module]
    root: weakref.ref[torch.nn.Module]
    candidate: bool  # not a root, not an island
    samples: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (min, max) per output
    outputs: tuple[str, ...] | None = None


class HeadroomWatch:
    """Every ``every`` optimizer steps, the largest float16 magnitude inside each module, on the device.

    ``headroom``: a module whose peak reaches ``65504 / headroom`` gets the verdict.
    """

    def __init__(self, every: int, headroom: float) -> None:
        self.every = every if TorchDispatchMode is not None else 0
        self.limit = FLOAT16_MAX / headroom
        self.headroom = headroom
        self._handles: list[Any] = []
        self._thread = 0
        self._stack: list[_Slot] = []
        self._slots: dict[int, _Slot] = {}
        self._mode: Any = None
        self._mode_depth = 0  # the stack's length when the mode was entered: it is left with that module
        self._opaque: torch.nn.Module | None = None  # a compiled root being called: nothing inside is watched
        self._watched_step = 0
        self._passes = 0
        self.broken = False  # after an error: no more watching
        self._due = False  # the second iteration is watched, then one every ``every`` optimizer steps
        # Per scaler: the last ``(step - 1) // every`` seen at its update (each model is watched at its 2nd step).
        self._periods: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.pending: Sighting | None = None  # finished, its verdict not decoded yet
        self.in_read = False  # the pending verdict rode on this iteration's read
        self.last: Sighting | None = None  # the last sighting whose iteration did not overflow

    @property
    def watching(self) -> bool:
        return bool(self._handles)

    def busy(self) -> bool:
        """Whether the update must look at the watch (it watches, or a verdict waits, or a watch is due)."""
        return self._due or bool(self._handles) or self.pending is not None

    # -- the schedule ------------------------------------------------------------------------------

    def after_update(self, step: int, may_watch: bool, scaler: Any = None) -> None:
        """At the end of an update: arm for the next iteration when due (``may_watch``: the probe is not armed)."""
        # Due at the first update of each period of ``every`` optimizer steps: with several optimizers per
        # iteration the step count moves by more than one per update, so "step % every == 1" could never hold.
        if self.every and scaler is not None and (step - 1) // self.every != self._periods.get(scaler, -1):
            self._periods[scaler] = (step - 1) // self.every
            self._due = True
        if self._due and may_watch and not self._handles and self.pending is None:
            self._due = False
            self._watched_step = step + 1
            self._arm()

    def restart(self) -> None:
        """Another model trains now (the scaler before was freed): forget the last sighting, watch its 2nd step."""
        self.last = None

    def watch_next(self, step: int) -> bool:
        """Watch the next iteration now, off the schedule (``ampguard bench`` times a watched step this way)."""
        if self._handles or self.pending is not None:
            return False
        self._watched_step = step + 1
        self._arm()
        return True

    def _arm(self) -> None:
        self._passes = 0
        self._slots = {}
        self._stack = []
        self._thread = threading.get_ident()
        self._handles = [
            nn_module.register_module_forward_pre_hook(self._before),
            nn_module.register_module_forward_hook(self._after, always_call=True),
        ]

    def stop(self) -> None:
        """Remove the hooks and forget the pass (uninstall, an error, the probe arming)."""
        self._remove()
        self._slots = {}
        self.pending = None
        self.in_read = False

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._mode is not None:  # a forward pass that never finished (an exception escaped the hooks)
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)
        self._stack = []
        self._opaque = None

    # -- the pass ----------------------------------------------------------------------------------

    def _before(self, module: torch.nn.Module, args: Any) -> None:
        # is_compiling() first: dynamo cannot trace threading.get_ident() (a graph break; with fullgraph=True an error)
        if is_compiling() or threading.get_ident() != self._thread or self._opaque is not None:
            return
        if _in_backward():  # activation checkpointing recomputing a forward: not a new pass
            return
        try:
            if not self._stack and (is_compiled(module) or self._passes >= MAX_PASSES):
                self._opaque = module  # compiled code is not watched (nor changed: see islands), nor a 65th pass
                return
            if not self._stack:
                self._passes += 1
            slot = self._slots.get(id(module))
            if slot is None or slot.module() is not module:
                root = self._stack[0].module() if self._stack else module
                candidate = bool(self._stack) and not islands.holds(module)
                root_ref = weakref.ref(root if root is not None else module)
                slot = self._slots[id(module)] = _Slot(weakref.ref(module), root_ref, candidate)
            elif not self._stack:
                slot.candidate = False  # called as the root too: its own code is never islanded
            self._stack.append(slot)
            if self._mode is None and (slot.candidate or module is unwrap(self._stack[0].module() or module)):
                self._mode = _Observer(self)
                self._mode.__enter__()
                self._mode_depth = len(self._stack)
        except Exception as error:  # an observation must never break the forward pass
            self.fail(error)

    def _after(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if is_compiling() or threading.get_ident() != self._thread:  # (compiled: _before pushed nothing either)
            return
        if self._opaque is not None:
            if self._opaque is module:
                self._opaque = None
            return
        if not self._stack or self._stack[-1].module() is not module:
            return
        slot = self._stack.pop()
        try:
            if slot.candidate and slot.outputs is None and output is not None:
                slot.outputs = output_kinds(tensors(output))
        except Exception:
            slot.outputs = None
        if self._mode is not None and len(self._stack) < self._mode_depth:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    def measure(self, output: Any) -> None:
        """One op's output, inside the innermost module running: its float16 extremes, on the device."""
        if not self._stack or self.broken:
            return
        slot = self._stack[-1]
        if not slot.candidate:
            return
        for tensor in output if isinstance(output, (tuple, list)) else (output,):
            if (
                type(tensor) in _PLAIN_TENSORS  # not a subclass (DTensor ...): its aminmax may not exist
                and tensor.dtype == torch.float16
                and tensor.layout == torch.strided
                and not tensor.is_nested  # (nn.TransformerEncoder's fast path: no aminmax for them)
                and tensor.numel()
            ):
                low, high = torch.aminmax(tensor)
                slot.samples.append((low, high))

    # -- the end of the watched iteration ---------------------------------------------------------

    def finish(self) -> Sighting | None:
        """Stop watching; the pass's peaks and verdict, on the device (no read). None: nothing was seen."""
        slots = [slot for slot in self._slots.values() if slot.candidate and slot.samples]
        self._remove()
        self._slots = {}
        if not slots or self.broken:
            return None
        try:
            self.pending = self._summarise(slots)
        except Exception as error:  # never the reason a run dies
            self.fail(error)
        return self.pending

    def _summarise(self, slots: list[_Slot]) -> Sighting:
        device = slots[0].samples[0][0].device
        lows = torch.stack([low.to(device) for slot in slots for low, _ in slot.samples]).float()
        highs = torch.stack([high.to(device) for slot in slots for _, high in slot.samples]).float()
        below = -lows
        below = below.masked_fill(below >= MASK_BAND, 0.0)
        extremes = torch.maximum(highs, below)
        nonfinite = (extremes.isnan() | (highs == float("inf"))).any().float()
        per_output = torch.nan_to_num(extremes, nan=0.0, posinf=0.0, neginf=0.0)
        peaks = torch.stack([part.amax() for part in per_output.split([len(slot.samples) for slot in slots])])
        values, order = peaks.topk(min(SHOWN, len(slots)))
        fits = values[0] >= self.limit
        if len(slots) > MAX_CALLS:  # the verdict must fit its bits of the scaler's read
            fits = fits & (order[0] < MAX_CALLS)
        verdict = torch.where(fits, order[0] + 1, 0).float()
        summary = HostCopy(torch.cat([verdict.reshape(1), nonfinite.reshape(1), values, order.float()]))
        modules = [(slot.module, slot.root) for slot in slots]
        outputs = [slot.outputs for slot in slots]
        return Sighting(modules, outputs, verdict, summary, step=self._watched_step)

    def fail(self, error: Exception) -> None:
        """After an error inside the watch: it stops for good, with one WARNING; training goes on without it."""
        if not self.broken:
            self.broken = True
            self.every = 0
            self._due = False
            logger.warning(
                "ampguard's headroom watch stopped after an error (%s: %s) and does not watch again; training goes "
                "on without it (forward overflows are still found by the probe).",
                type(error).__name__,
                str(error).splitlines()[0][:200] if str(error) else "",
            )

    def add_to(self, code: torch.Tensor, weight: float) -> torch.Tensor:
        """``code + weight * verdict`` when this iteration was watched (the scaler's one read carries it)."""
        if self._handles:
            self.finish()
        if self.pending is None:
            return code
        self.in_read = True
        return code + weight * self.pending.verdict.to(code.device, non_blocking=True)

    def settle(self, overflow: bool) -> Sighting | None:
        """At the update after a watched iteration: the sighting whose verdict was read (None: none this time).

        A sighting of an iteration without forward overflow becomes :attr:`last`, which a later overflow blames.
        """
        if self._handles:  # watched, but no step() read its verdict (no optimizer stepped): seen all the same
            self.finish()
        sighting, self.pending, self.in_read = self.pending, None, False
        if sighting is not None and not overflow:
            sighting.clean = True
            self.last = sighting
        return sighting

    def suspect(self) -> tuple[tuple[torch.nn.Module, torch.nn.Module, tuple[str, ...] | None], float, int] | None:
        """The module the last clean sighting saw closest to the limit, its peak and step, when within BLAME_BOUND.

        Modules that became islands since are passed over (their float32 output, given back as float16, is the
        overflow of their caller). Once per sighting; no read (:class:`~ampguard.syncs.HostCopy`).
        """
        sighting = self.last
        if sighting is None or sighting.blamed:
            return None
        sighting.blamed = True  # if the overflows go on, the probe looks
        if sighting.shown is None:
            sighting.read_verdict()
        for index, peak in sighting.top:
            if peak < FLOAT16_MAX / BLAME_BOUND:
                return None
            found = sighting.candidate(index)
            if found is not None and not islands.holds(found[0]):
                return found, float(peak), sighting.step
        return None


if TorchDispatchMode is not None:

    class _Observer(TorchDispatchMode):
        """Each aten op's output during a watched forward pass, handed to the watch."""

        def __init__(self, watch: HeadroomWatch) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self.watch = watch

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            output = func(*args, **(kwargs or {}))
            if not func.is_view:
                try:
                    self.watch.measure(output)
                except Exception as error:  # a measurement must never break the forward pass
                    self.watch.fail(error)
            return output
