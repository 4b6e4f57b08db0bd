"""The sampled measurement: how much of one backward pass's float16 gradient traffic the loss scale loses.

Armed for one optimizer step (:meth:`Sampler.arm`), a global module forward
hook walks the autograd graph each module call just built and registers a
pre-hook on every node found: the node's incoming gradient (the gradient of
the tensor that op produced, or for a leaf's accumulator the leaf's gradient)
is counted when the backward pass reaches it, if it is float16. Every gradient
is counted once, in the innermost module whose output led to it (children
finish their forward before their parent): a node hooked is marked in its own
``metadata``, so the sample holds no node and no graph. The gradients of
float16 weight copies (autocast's casts) are counted with the module that cast
them, those of float16 parameters with the module that used them. Nothing is
changed: the hooks return nothing, and an error inside them ends the sample
(reported once), never the step.

Per module, on the device (:class:`Tally`): the number of values, of exact
zeros, of values below ``2**-22`` (zeros and the two lowest subnormal
octaves) and of values below ``2**-14`` (zeros and subnormals), and the
largest magnitude. :class:`Transfer` brings them to the host without a
synchronisation (on CUDA a copy into pinned memory and an event polled later). Healthy steps run none of this: the hooks exist only
between :meth:`Sampler.arm` and :meth:`Sampler.finish`.

What the counts mean (:class:`Measurement`): a subnormal keeps fewer than
11 significant bits (at ``2**-24`` just one); an exact zero may be a true zero
(a ReLU's mask, padding) or a value flushed by the scale. The flushed share is
estimated from the two octaves just above float16's smallest subnormal: as
many values lie in the two octaves just below (a smooth log-magnitude density,
which gradients have: Chmiel et al. 2021), and those are the zeros a loss
scale 4x as large would have kept (never more than the zeros counted).
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import torch
from torch import nn

import ampguard.containment as containment
from ampguard.syncs import HostCopy
from ampguard.torch_privates import is_compiling

SMALLEST_NORMAL = 2.0**-14
LOW_OCTAVES = 2.0**-22  # float16's two lowest subnormal octaves lie in [2**-24, 2**-22)
FLOAT16_MAX = 65504.0

# Nodes whose incoming gradient holds the same values as a gradient counted elsewhere (a view's, a slice's, a
# split's pieces, a clone's, an in-place write's through a view, CopySlices: its base's): walked through, not
# counted twice.
SAME_VALUES = frozenset(
    {
        "AliasBackward0",
        "AsStridedBackward0",
        "CloneBackward0",
        "CopySlices",
        "ExpandBackward0",
        "PermuteBackward0",
        "ReshapeAliasBackward0",
        "SelectBackward0",
        "SliceBackward0",
        "SplitBackward0",
        "SplitWithSizesBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "SqueezeBackward2",
        "TBackward0",
        "TransposeBackward0",
        "UnbindBackward0",
        "UnsafeSplitBackward0",
        "UnsafeViewBackward0",
        "UnsqueezeBackward0",
        "ViewBackward0",
    }
)


class Tally:
    """One module's counts on the device and its peak magnitude.

    ``counts``: ``[zeros, below 2**-22, below 2**-14]`` of the gradients that hold a normal value, and the
    number of values of those that hold none (every value zero or subnormal: a gradient the scale sank).
    """

    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self.values = 0  # known on the host: the sizes of the gradients counted
        self.counts = torch.zeros(4, dtype=torch.int64, device=device)
        self.peak = torch.zeros((), dtype=torch.float32, device=device)

    def add(self, gradient: torch.Tensor) -> None:
        magnitude = gradient.detach().abs()
        peak = magnitude.amax().float()
        sunk = peak < SMALLEST_NORMAL  # no normal value left: every value counts as lost
        below = torch.stack(
            [(magnitude == 0).sum(), (magnitude < LOW_OCTAVES).sum(), (magnitude < SMALLEST_NORMAL).sum()]
        )
        counts = torch.cat([torch.where(sunk, 0, below), (sunk * gradient.numel()).reshape(1)])
        self.counts.add_(counts.to(self.counts.device, non_blocking=True))
        torch.maximum(self.peak, peak.to(self.peak.device, non_blocking=True), out=self.peak)
        self.values += gradient.numel()


@dataclass(frozen=True)
class Counts:
    """The host's counts of one module, or of all."""

    values: int = 0
    zeros: int = 0
    low: int = 0  # zeros and the two lowest subnormal octaves
    below_normal: int = 0  # zeros and subnormals
    sunk: int = 0  # values of gradients without a normal value (all counted as lost)
    peak: float = 0.0

    @classmethod
    def read(cls, *values: float) -> Counts:
        """From the host's copy: ``values, zeros, low, below_normal, sunk, peak`` (counts as floats)."""
        count, zeros, low, below_normal, sunk, peak = values
        return cls(int(count), int(zeros), int(low), int(below_normal), int(sunk), float(peak))

    @property
    def subnormal(self) -> int:
        return self.below_normal - self.zeros

    @property
    def flushed(self) -> int:
        """Values lost: zeros a 4x scale would have kept (estimated: see the module's docstring), and every
        value of the gradients the scale sank below the normal range."""
        return min(self.zeros, self.low - self.zeros) + self.sunk

    @property
    def underflow(self) -> int:
        """Values degraded (subnormal) or lost (flushed) at the current scale."""
        return self.subnormal + self.flushed

    def share(self, count: int) -> float:
        return count / self.values if self.values else 0.0

    def as_list(self) -> list[int | float]:
        """Plain data (checkpoints): ``[values, zeros, low, below_normal, sunk, peak]``."""
        return [self.values, self.zeros, self.low, self.below_normal, self.sunk, self.peak]

    @classmethod
    def from_list(cls, saved: Any) -> Counts:
        values, zeros, low, below_normal, sunk, peak = saved
        return cls(int(values), int(zeros), int(low), int(below_normal), int(sunk), float(peak))

    def __add__(self, other: Counts) -> Counts:
        return Counts(
            self.values + other.values,
            self.zeros + other.zeros,
            self.low + other.low,
            self.below_normal + other.below_normal,
            self.sunk + other.sunk,
            max(self.peak, other.peak),
        )


@dataclass(frozen=True)
class Measurement:
    """One sampled step: the counts of every module that had float16 gradients, and their sum."""

    step: int
    scale: float
    total: Counts
    modules: dict[str, Counts] = field(default_factory=dict)

    @property
    def subnormal_share(self) -> float:
        return self.total.share(self.total.subnormal)

    @property
    def flushed_share(self) -> float:
        return self.total.share(self.total.flushed)

    @property
    def underflow_share(self) -> float:
        return self.total.share(self.total.underflow)

    def as_plain(self) -> dict[str, Any]:
        """Plain data (checkpoints): Python numbers, strings, lists and dicts."""
        return {
            "step": self.step,
            "scale": float(self.scale),
            "total": self.total.as_list(),
            "modules": {name: counts.as_list() for name, counts in self.modules.items()},
        }

    @classmethod
    def from_plain(cls, saved: Any) -> Measurement:
        modules = {str(name): Counts.from_list(counts) for name, counts in dict(saved.get("modules", {})).items()}
        return cls(int(saved["step"]), float(saved["scale"]), Counts.from_list(saved["total"]), modules)

    def worst_modules(self, count: int = 3) -> tuple[tuple[str, float], ...]:
        """The modules that lose the largest share of their gradient values, with that share."""
        ranked = sorted(
            ((name, counts.share(counts.underflow)) for name, counts in self.modules.items() if counts.underflow),
            key=lambda item: -item[1],
        )
        return tuple((name, round(share, 6)) for name, share in ranked[:count])


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _counted(node: Any) -> bool:
    """Whether ``node``'s incoming gradient is counted: not a view's (counted as its base's), and a leaf's
    accumulator only for a float16 leaf (a float32 master's gradient is never float16)."""
    kind = type(node).__name__
    if kind == "AccumulateGrad":
        return bool(node.variable.dtype == torch.float16)
    return kind not in SAME_VALUES


def _countable(gradient: torch.Tensor | None) -> TypeGuard[torch.Tensor]:
    """A dense float16 gradient with values (sparse and nested ones are not counted)."""
    return (
        gradient is not None
        and gradient.dtype == torch.float16
        and gradient.layout == torch.strided
        and not gradient.is_nested
        and gradient.numel() > 0
    )


class Sampler:
    """Owns one sampled step: its hooks while armed, its tallies until read.

    An armed sampler that is never finished (its scaler dropped, training over
    with the sample due) disarms itself after :data:`MAX_CALLS` outermost module
    calls without a backward pass through the sample between them: it never
    keeps walking graphs. A validation that long drops the sample (the listener
    tries again at the next scheduled step).
    """

    MAX_CALLS = 1024  # a forward pass that is no module call itself may make a few hundred (a loop over layers)

    def __init__(self) -> None:
        self.tallies: dict[int, Tally] = {}  # id(module) -> its tally, for this sample
        self._modules: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()
        self._mark = f"ampguard.underflow.{id(self)}"  # node.metadata key: the session that hooked the node
        # The node hooks' handles, removed when the sample ends: a node kept across samples (a parameter's
        # accumulator, which DistributedDataParallel keeps) carries no hook between them.
        self._node_hooks: list[Any] = []
        self._handles: list[Any] = []
        self._calls = 0  # outermost module calls since armed, or since the sample's last backward
        # Per thread, per module call in progress: the nodes of its inputs (where its walk ends); its length is
        # the call depth (another thread's module calls are not this thread's children).
        self._calls_in_progress = threading.local()
        self._names: dict[int, str] = {}  # id(module) -> qualified name in the outermost module called
        self._session = 0  # node hooks of an earlier sample (a retained graph) do nothing

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def arm(self) -> None:
        """Hooks on for the next forward and backward passes."""
        if self.armed:
            return
        self._session += 1
        self._remove_node_hooks()  # (a sample dropped before its finish)
        self.tallies, self._names, self._calls_in_progress = {}, {}, threading.local()
        self._calls = 0
        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(self._pre_forward),
            # always_call: a forward that raises (a batch skipped after an out-of-memory error) still leaves
            # its depth, so later calls are known as outermost again
            nn.modules.module.register_module_forward_hook(self._post_forward, always_call=True),
        ]

    def disarm(self) -> None:
        """No more hooks on module calls; node hooks already registered stay until their graph is freed."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _remove_node_hooks(self) -> None:
        """Never from a node hook: the backward pass may be iterating the hooks of that node."""
        for hook in self._node_hooks:
            hook.remove()
        self._node_hooks = []

    def _fail(self, where: str, error: Exception) -> None:
        """ampguard's own error inside a hook: reported once, the sample dropped, the step goes on."""
        self.disarm()
        self._session += 1  # the node hooks already registered do nothing
        self.tallies = {}
        containment.report(f"underflow sample ({where})", error)

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if is_compiling():
            return
        try:
            self._enter(module, args)
        except Exception as error:
            self._fail("module forward pre-hook", error)

    def _inputs(self) -> list[set[Any]]:
        """This thread's module calls in progress (the nodes of their inputs)."""
        inputs: list[set[Any]] | None = getattr(self._calls_in_progress, "inputs", None)
        if inputs is None:
            inputs = self._calls_in_progress.inputs = []
        return inputs

    def _enter(self, module: nn.Module, args: Any) -> None:
        in_progress = self._inputs()
        if not in_progress:
            self._calls += 1
            if self._calls > self.MAX_CALLS:  # nobody finishes this sample
                self.disarm()
                self.tallies = {}
                return
        if not in_progress and id(module) not in self._names:
            for name, child in module.named_modules():
                self._names.setdefault(id(child), name or type(module).__name__)
        in_progress.append({t.grad_fn for t in _tensors(args) if t.grad_fn is not None})

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self.armed or is_compiling():
            return
        try:
            self._leave(module, output)
        except Exception as error:
            self._fail("module forward hook", error)

    def _leave(self, module: nn.Module, output: Any) -> None:
        in_progress = self._inputs()
        inputs = in_progress.pop() if in_progress else set()
        if not torch.is_grad_enabled():
            return
        nodes = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
        if nodes:
            self._hook_graph(module, nodes, inputs)

    def _hook_graph(self, module: nn.Module, stack: list[Any], inputs: set[Any]) -> None:
        """Hook the nodes this module call made that no module inside it hooked: from its outputs down to
        its inputs' nodes (its caller's). The walk goes through what its children hooked to reach the nodes
        it made itself between them (an attention's matmuls between its projections)."""
        slot = id(module)
        session = self._session
        seen = set(inputs)
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if node.metadata.get(self._mark) != session and _counted(node):
                node.metadata[self._mark] = session
                hook = node.register_prehook(
                    lambda grads, slot=slot, session=session: self._count(slot, session, grads)
                )
                self._node_hooks.append(hook)  # (the handle holds no node)
            stack.extend(next_node for next_node, _ in node.next_functions)
        self._modules[slot] = module

    def _count(self, slot: int, session: int, gradients: tuple[torch.Tensor | None, ...]) -> None:
        if session != self._session:
            return
        self._calls = 0  # a backward pass through the sample: training goes on
        try:
            for gradient in gradients:
                if not _countable(gradient):
                    continue
                tally = self.tallies.get(slot)
                if tally is None:
                    module = self._modules.get(slot)
                    name = self._names.get(slot) or (type(module).__name__ if module is not None else "?")
                    tally = self.tallies[slot] = Tally(name, gradient.device)
                tally.add(gradient)
        except Exception as error:
            self._fail("backward node hook", error)

    def finish(self) -> list[Tally]:
        """End the sample: no more counting; the tallies, to :func:`read`."""
        self.disarm()
        self._session += 1
        self._remove_node_hooks()
        tallies, self.tallies = list(self.tallies.values()), {}
        return tallies


def totals(tallies: list[Tally]) -> torch.Tensor:
    """All tallies in one float64 tensor, ``[values, zeros, low, below_normal, sunk, peak]``, on their device.

    The same size whatever was counted (zeros on the CPU when nothing was): what
    ranks exchange (:func:`ampguard.distributed.agree_on_underflow`). No read.
    """
    device = tallies[0].counts.device if tallies else torch.device("cpu")
    total = torch.zeros(6, dtype=torch.float64, device=device)
    total[0] = float(sum(t.values for t in tallies))
    for t in tallies:
        total[1:5] += t.counts.to(device, torch.float64)
        torch.maximum(total[5], t.peak.to(device, torch.float64), out=total[5])
    return total


class Transfer:
    """A sample's counts on their way to the host, known without a synchronisation.

    On CUDA a ``non_blocking`` copy into pinned memory and an event, polled by
    :attr:`ready` (:class:`~ampguard.syncs.HostCopy`); on the CPU the counts are
    host memory already. On another accelerator (no event to poll) :meth:`result`
    reads them (one counted read, on the step that finds the sample finished).

    ``total``: the ranks' totals (:func:`totals` agreed between them), which the
    measurement's total then is; its modules stay this rank's.
    """

    def __init__(
        self,
        tallies: list[Tally],
        step: int,
        scale: float,
        extra: torch.Tensor | None = None,
        total: torch.Tensor | None = None,
    ) -> None:
        self.step, self.scale = step, scale
        self.tallies = [(t.name, t.values) for t in tallies]
        self.agreed = total is not None
        device = (
            tallies[0].counts.device
            if tallies
            else extra.device
            if extra is not None
            else total.device
            if total is not None
            else torch.device("cpu")
        )
        exact = torch.float32 if device.type == "mps" else torch.float64  # (MPS has no float64)
        pieces = [total.to(device, exact)] if total is not None else []
        pieces += [torch.cat([t.counts.to(device, exact), t.peak.to(device, exact).reshape(1)]) for t in tallies]
        if extra is not None:
            pieces.append(extra.to(device, exact).flatten())
        self._copy = HostCopy(torch.cat(pieces) if pieces else torch.zeros(0, dtype=exact))

    @property
    def copying(self) -> bool:
        """Whether the counts come through a copy and an event (CUDA): :attr:`ready` may be False for a while."""
        return self._copy.event is not None

    @property
    def ready(self) -> bool:
        """Whether :meth:`result` costs no synchronisation (elsewhere than CUDA and the CPU: asked at once)."""
        return not self.copying or self._copy.ready

    def result(self) -> tuple[Measurement, list[float]]:
        """The measurement, and the values of the caller's ``extra``; reads the device for a copy not yet done."""
        values = self._copy.values()
        agreed = values[:6] if self.agreed else []
        values = values[len(agreed) :]
        modules: dict[str, Counts] = {}
        for index, (name, count) in enumerate(self.tallies):
            counts = Counts.read(count, *values[5 * index : 5 * index + 5])
            modules[name] = modules[name] + counts if name in modules else counts
        total = Counts()
        for counts in modules.values():
            total = total + counts
        if agreed:
            total = Counts.read(*agreed)
        rest = values[5 * len(self.tallies) :]
        scale = rest[0] if math.isnan(self.scale) and rest else self.scale
        return Measurement(self.step, scale, total, modules), rest


def read(
    tallies: list[Tally], step: int, scale: float, extra: torch.Tensor | None = None
) -> tuple[Measurement, list[float]]:
    """The tallies on the host at once, and the values of ``extra``.

    ``scale``: the loss scale the sampled step ran at (NaN: it is the first value of ``extra``).
    """
    return Transfer(tallies, step, scale, extra).result()
