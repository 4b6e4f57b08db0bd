"""What a sampled step's counts are, and how they reach the host.

Per module, on the device (:class:`Tally`): the number of values, of exact
zeros, of zeros estimated flushed, of subnormals and zeros, of values lost
whole, and the largest magnitude. :class:`Transfer` brings them to the host
without a synchronisation (:class:`~ampguard.syncs.HostCopy`: on CUDA a copy
into pinned memory and an event polled later).

What the counts mean (:class:`Measurement`). A subnormal keeps fewer than 11
significant bits (at ``2**-24`` just one). A value is *lost* where float16 holds
an exact zero and float32 would hold the value nonzero: a zero that float32
has too (a ReLU's mask, padding, a ``0.0 * aux_loss`` term, a loss weight
ramped up from 0, a zero-initialised LoRA ``B``) is never lost. float32's value
is not computed (that would be a second backward pass), so lost values are
estimated from what float16 shows, per gradient:

* a gradient with a nonzero value: its zeros that float32 would hold below
  ``2**-25`` (float16 rounds those to zero), estimated from the density of its
  values just above: the values at ``2**-24`` stand for the float32 values in
  ``[2**-25, 3 * 2**-25)``, twice the width of ``[0, 2**-25)``, and where
  there are more of them than at ``2**-23`` the density still rises toward
  zero and is extrapolated by that ratio. Never more than that gradient's
  zeros, so a gradient whose zeros are all true (a ReLU mask) and whose
  smallest values are not at the bottom of the subnormal range loses nothing.
  tests/test_underflow_float32_reference.py checks the estimate against the
  same backward pass in float32;
* a gradient of exact zeros only: lost whole when a gradient it was computed
  from was *flushed*: it held nonzero values but no normal one, or it was
  itself exact zeros computed from a flushed one (a zero computed from a
  sinking gradient is the flush going on). Otherwise (computed from gradients
  with a normal value, whose exact zeros come from an exact zero factor such as
  the ``0.0`` weight or the zero ``B``; or from no counted gradient, a model
  output whose gradient the loss's operations outside any module made) its
  zeros are true zeros, unless no float16 gradient of the step held a normal
  value: then the loss itself underflowed and they are lost too.

Whether a gradient was flushed (:func:`passed_on`) travels down the autograd
graph with the sample's node hooks (:mod:`ampguard.underflow.measure`), as a
device boolean: no read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ampguard.syncs import HostCopy

SMALLEST_NORMAL = 2.0**-14
LOW_OCTAVES = 2.0**-22  # float16's two lowest subnormal octaves lie in [2**-24, 2**-22) (checkpoints before 0.2)
SMALLEST_SUBNORMAL = 2.0**-24
FLOAT16_MAX = 65504.0
# The peak recorded for a step whose float16 gradients held inf or NaN (an overflow, skipped or masked further down
# by a ReLU): finite, so that checkpoints hold it, and above every float16 value, so that no scale grows for it.
OVERFLOWED = 65536.0
# What a lost value adds to a gradient's squared norm (scaled units), for the share of the norm lost
# (Counts.lost_norm): taken at 2**-25, below which float16 rounds to zero. A bound for the values flushed there;
# those lost downstream of a flush (computed from flushed gradients) may be larger. Against float32
# (tests/test_underflow_float32_reference.py) it errs by at most a factor of 3 and takes the same side of the
# policy's 1% in every case there; a uniform density below 2**-25 (a third of it) missed the attention net's 2.8%
# at 2**16 (0.8%).
LOST_VALUE_SQUARE = (2.0**-25) ** 2


def passed_on(peak: torch.Tensor, fed: torch.Tensor | bool, below: torch.Tensor | None = None) -> torch.Tensor:
    """Whether a gradient whose largest magnitude is ``peak`` was flushed (a boolean on its device): it held
    nonzero values but no normal one, or only exact zeros and ``fed`` (one of the gradients it was computed from
    was flushed; False: none was, or none was counted). NaN and inf count as normal values. ``below``: ``peak <
    2**-14``, where the caller has it."""
    below = peak < SMALLEST_NORMAL if below is None else below
    if isinstance(fed, bool):
        return below if fed else below & (peak > 0)
    return below & ((peak > 0) | on(fed, peak.device))


def on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device`` (a copy without a synchronisation where it is elsewhere: a model across devices)."""
    return tensor if tensor.device == device else tensor.to(device, non_blocking=True)


class Tally:
    """One module's counts on the device and its peak magnitude.

    ``counts``: of the gradients with a nonzero value, ``[zeros, zeros + zeros estimated flushed, zeros +
    subnormals]``; then the values of the all-zero gradients lost whole (flushed: :func:`passed_on`), and those
    of every all-zero gradient (the difference: exact zeros not flushed, true zeros or lost where the step held
    no normal value at all: :meth:`Transfer.result`, :func:`totals`).

    :meth:`add` keeps each gradient's raw counts (a few reductions, no read); :func:`settle` turns the pending
    ones of every tally into ``counts`` at once, at the end of the sample, so a sampled step's cost per gradient
    stays a handful of device operations.

    ``fed``: whether one of the gradients the next one added was computed from was flushed, set by the sampler
    before each :meth:`add`.
    """

    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self.device = device
        self.values = 0  # known on the host: the sizes of the gradients counted
        self.counts = torch.zeros(5, dtype=torch.int64, device=device)
        self.peak = torch.zeros((), dtype=torch.float32, device=device)
        self.energy = torch.zeros((), dtype=torch.float64, device=device)  # the squared norms of its gradients
        self.fed: torch.Tensor | bool = False
        # per gradient added since the last settle: [zeros, at 2**-24, at 2**-23, below normal], peak, fed, size,
        # norm
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | bool, int, torch.Tensor]] = []

    def add(self, gradient: torch.Tensor) -> torch.Tensor:
        """Count ``gradient``, fed :attr:`fed`; returns whether it was flushed (:func:`passed_on`). No read."""
        magnitude = gradient.detach().abs()
        peak = magnitude.amax()
        flushed = passed_on(peak, self.fed)
        raw = torch.stack(
            [
                torch.count_nonzero(magnitude == 0),
                torch.count_nonzero(magnitude == SMALLEST_SUBNORMAL),
                torch.count_nonzero(magnitude == 2 * SMALLEST_SUBNORMAL),
                torch.count_nonzero(magnitude < SMALLEST_NORMAL),
            ]
        )
        norm = torch.linalg.vector_norm(magnitude, dtype=torch.float32)
        self.pending.append(
            (on(raw, self.device), on(peak, self.device), self.fed, gradient.numel(), on(norm, self.device))
        )
        self.values += gradient.numel()
        return flushed


def settle(tallies: list[Tally]) -> None:
    """Fold every tally's pending gradients into its ``counts`` and ``peak``: a few operations per device for all
    of them (the rule of the module's docstring), no read."""
    by_device: dict[torch.device, list[Tally]] = {}
    for tally in tallies:
        if tally.pending:
            by_device.setdefault(tally.device, []).append(tally)
    for device, group in by_device.items():
        rows = [row for tally in group for row in tally.pending]
        slots = torch.tensor([i for i, tally in enumerate(group) for _ in tally.pending], device=device)
        raw = torch.stack([row[0] for row in rows])
        peaks = torch.stack([row[1] for row in rows]).float()  # (float16: the tallies count float16 gradients)
        fed = torch.zeros(len(rows), dtype=torch.bool, device=device)
        fed_at = [i for i, row in enumerate(rows) if row[2] is not False]
        if fed_at:
            values = [row[2] if isinstance(row[2], torch.Tensor) else torch.tensor(True) for row in rows]
            fed[torch.tensor(fed_at, device=device)] = torch.stack([on(values[i], device) for i in fed_at])
        sizes = torch.tensor([row[3] for row in rows], dtype=torch.int64, device=device)
        zeros, lowest, next_lowest, below_normal = raw.unbind(1)
        # the zeros float32 would hold below 2**-25: half the values at 2**-24, times their ratio to those at
        # 2**-23 where the density still rises toward zero; at most all zeros
        estimate = lowest * torch.maximum(lowest, next_lowest) // (2 * next_lowest.clamp(min=1))
        whole = peaks == 0
        kept = torch.stack([zeros, zeros + torch.minimum(zeros, estimate), below_normal], dim=1)
        per_gradient = torch.cat(
            [kept.masked_fill(whole.unsqueeze(1), 0), torch.stack([whole & fed, whole], dim=1) * sizes.unsqueeze(1)],
            dim=1,
        )
        counts = torch.zeros(len(group), 5, dtype=torch.int64, device=device).index_add_(0, slots, per_gradient)
        maxima = torch.zeros(len(group), device=device).scatter_reduce_(0, slots, peaks, "amax")
        squares = torch.stack([row[4] for row in rows]).double().square()
        energies = torch.zeros(len(group), dtype=torch.float64, device=device).index_add_(0, slots, squares)
        for index, tally in enumerate(group):
            tally.counts = tally.counts + counts[index]
            tally.peak = torch.maximum(tally.peak, maxima[index])
            tally.energy = tally.energy + energies[index]
            tally.pending = []


def finite_peak(peak: float) -> float:
    """A peak as measurements keep it: :data:`OVERFLOWED` for inf or NaN."""
    return float(peak) if math.isfinite(peak) else OVERFLOWED


@dataclass(frozen=True)
class Counts:
    """The host's counts of one module, or of all (the module's docstring says what is lost).

    ``zeros``, ``low`` and ``below_normal`` are of the gradients not lost whole. ``low``: their zeros and the zeros
    estimated flushed, per gradient (so ``low - zeros`` is the estimate, never more than ``zeros``; a checkpoint of
    ampguard before issue 32 holds there the zeros and the values of the two lowest subnormal octaves, which
    :attr:`flushed` reads alike). ``peak``: :data:`OVERFLOWED` where a gradient held inf or NaN.
    """

    values: int = 0
    zeros: int = 0
    low: int = 0  # zeros and the zeros estimated flushed
    below_normal: int = 0  # zeros and subnormals
    sunk: int = 0  # values of the gradients lost whole (all-zero ones computed from a flushed one)
    peak: float = 0.0
    # The squared norm of the float16 gradients counted, in scaled units (NaN: not measured, a checkpoint of
    # ampguard before it).
    energy: float = math.nan

    @classmethod
    def read(cls, *values: float) -> Counts:
        """From the host's copy: ``values, zeros, low, below_normal, sunk, peak[, energy]`` (counts as floats)."""
        count, zeros, low, below_normal, sunk, peak, *energy = values
        squares = float(energy[0]) if energy else math.nan
        return cls(int(count), int(zeros), int(low), int(below_normal), int(sunk), finite_peak(peak), squares)

    @property
    def subnormal(self) -> int:
        return self.below_normal - self.zeros

    @property
    def flushed(self) -> int:
        """Values lost: zeros estimated flushed in gradients with a nonzero value, and every value of the
        all-zero gradients lost whole (see the module's docstring)."""
        return min(self.zeros, self.low - self.zeros) + self.sunk

    @property
    def underflow(self) -> int:
        """Values degraded (subnormal) or lost (flushed) at the current scale."""
        return self.subnormal + self.flushed

    @property
    def lost_norm(self) -> float:
        """The share of the gradients' norm lost: the norm of the values lost (each taken at ``2**-25``, where
        float16 rounds to zero: :data:`LOST_VALUE_SQUARE`) against that of all of them, kept and lost. What the
        update loses: values lost far below the gradients' others (a confident softmax's) lose nothing that
        float16's rounding of the large ones does not already lose. Without a measured norm (a checkpoint of
        ampguard before it), the share of values lost."""
        if math.isnan(self.energy):
            return self.share(self.flushed)
        lost = self.flushed * LOST_VALUE_SQUARE
        whole = self.energy + lost
        return math.sqrt(lost / whole) if whole > 0 and math.isfinite(whole) else 0.0

    def share(self, count: int) -> float:
        return count / self.values if self.values else 0.0

    def as_list(self) -> list[int | float]:
        """Plain data (checkpoints): ``[values, zeros, low, below_normal, sunk, peak, energy]`` (no energy where
        it is not known: a checkpoint holds finite numbers only)."""
        saved: list[int | float] = [self.values, self.zeros, self.low, self.below_normal, self.sunk, self.peak]
        return [*saved, self.energy] if math.isfinite(self.energy) else saved

    @classmethod
    def from_list(cls, saved: Any) -> Counts:
        values, zeros, low, below_normal, sunk, peak, *energy = saved
        squares = float(energy[0]) if energy else math.nan
        return cls(int(values), int(zeros), int(low), int(below_normal), int(sunk), float(peak), squares)

    def __add__(self, other: Counts) -> Counts:
        return Counts(
            self.values + other.values,
            self.zeros + other.zeros,
            self.low + other.low,
            self.below_normal + other.below_normal,
            self.sunk + other.sunk,
            max(self.peak, other.peak),
            self.energy + other.energy,
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

    @property
    def lost_norm_share(self) -> float:
        """The share of the gradients' norm lost (:attr:`Counts.lost_norm`): what the policy acts on."""
        return self.total.lost_norm

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
    """All tallies in one float64 tensor, ``[values, zeros, low, below_normal, sunk, energy, peak]``, on their
    device (the peak last: the ranks take its maximum, and the sum of the others).

    The same size whatever was counted (zeros on the CPU when nothing was): what
    ranks exchange (:func:`ampguard.distributed.agree_on_underflow`). The
    all-zero gradients not flushed are zeros, or lost (``sunk``) when no
    gradient of this rank held a normal value, as :meth:`Transfer.result`
    counts them. No read.
    """
    settle(tallies)
    device = tallies[0].counts.device if tallies else torch.device("cpu")
    total = torch.zeros(7, dtype=torch.float64, device=device)
    zeros = torch.zeros((), dtype=torch.float64, device=device)
    total[0] = float(sum(t.values for t in tallies))
    for t in tallies:
        counts = t.counts.to(device, torch.float64)
        total[1:5] += counts[:4]
        zeros += counts[4] - counts[3]
        total[5] += t.energy.to(device, torch.float64)
        torch.maximum(total[6], t.peak.to(device, torch.float64), out=total[6])
    lost = total[6] < SMALLEST_NORMAL
    total[1:4] += zeros * ~lost
    total[4] += zeros * lost
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
        settle(tallies)
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
        pieces += [
            torch.cat(
                [t.counts.to(device, exact), t.peak.to(device, exact).reshape(1), t.energy.to(device, exact).reshape(1)]
            )
            for t in tallies
        ]
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
        agreed = values[:7] if self.agreed else []  # (totals' layout: the energy before the peak)
        values = values[len(agreed) :]
        rows = [values[7 * index : 7 * index + 7] for index in range(len(self.tallies))]
        # all-zero gradients not flushed: true zeros, lost when no gradient of the step held a normal value
        lost = max((finite_peak(row[5]) for row in rows), default=0.0) < SMALLEST_NORMAL
        modules: dict[str, Counts] = {}
        for (name, count), (zeros, low, below_normal, sunk, below, peak, energy) in zip(self.tallies, rows):
            true, sunk = (0.0, below) if lost else (below - sunk, sunk)
            counts = Counts.read(count, zeros + true, low + true, below_normal + true, sunk, peak, energy)
            modules[name] = modules[name] + counts if name in modules else counts
        total = Counts(energy=0.0)
        for counts in modules.values():
            total = total + counts
        if agreed:
            total = Counts.read(*agreed[:5], agreed[6], agreed[5])
        rest = values[7 * len(self.tallies) :]
        scale = rest[0] if math.isnan(self.scale) and rest else self.scale
        return Measurement(self.step, scale, total, modules), rest


def read(
    tallies: list[Tally], step: int, scale: float, extra: torch.Tensor | None = None
) -> tuple[Measurement, list[float]]:
    """The tallies on the host at once, and the values of ``extra``.

    ``scale``: the loss scale the sampled step ran at (NaN: it is the first value of ``extra``).
    """
    return Transfer(tallies, step, scale, extra).result()
