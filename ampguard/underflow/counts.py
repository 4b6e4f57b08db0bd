"""What a sampled step's counts are, and how they reach the host.

Per module, on the device (:class:`Tally`): the number of values, of exact
zeros, of values below ``2**-22`` (zeros and the two lowest subnormal
octaves) and of values below ``2**-14`` (zeros and subnormals), and the
largest magnitude. :class:`Transfer` brings them to the host without a
synchronisation (:class:`~ampguard.syncs.HostCopy`: on CUDA a copy into
pinned memory and an event polled later).

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
from dataclasses import dataclass, field
from typing import Any

import torch

from ampguard.syncs import HostCopy

SMALLEST_NORMAL = 2.0**-14
LOW_OCTAVES = 2.0**-22  # float16's two lowest subnormal octaves lie in [2**-24, 2**-22)
FLOAT16_MAX = 65504.0


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
