"""What a sampled step's counts are, and how they reach the host.

Per gradient, on the device (:mod:`ampguard.underflow.gradients`): the number
of exact zeros, of values at the two smallest subnormals, of subnormals and
zeros, of zeros in sinking columns, the largest magnitude and the squared norm.
:class:`Transfer` brings them to the host without a synchronisation
(:class:`~ampguard.syncs.HostCopy`: on CUDA a copy into pinned memory and an
event polled later), where :func:`judge` makes them counts per module.

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
  A gradient that was flushed (no normal value) or computed from a flushed one
  also loses the zeros of its sinking columns (along its last dimension, those
  whose largest value is ``2**-24`` or ``2**-23``: a qkv projection's queries
  and keys, flushed inside the attention beside the values). A parameter's
  gradient is computed from its module's output's.
  tests/underflow/test_underflow_float32_reference.py checks the estimate against the
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

Which all-zero gradients were computed from a flushed one is judged on the host
(:mod:`ampguard.underflow.flushes`), from the autograd nodes the gradients
reached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ampguard.syncs import HostCopy
from ampguard.underflow.flushes import lost_whole
from ampguard.underflow.gradients import ROW, SMALLEST_NORMAL, Entry, Gradients, exact

LOW_OCTAVES = 2.0**-22  # float16's two lowest subnormal octaves lie in [2**-24, 2**-22) (checkpoints before 0.2)
FLOAT16_MAX = 65504.0
# The peak recorded for a step whose float16 gradients held inf or NaN (an overflow, skipped or masked further down
# by a ReLU): finite, so that checkpoints hold it, and above every float16 value, so that no scale grows for it.
OVERFLOWED = 65536.0
# What a lost value adds to a gradient's squared norm (scaled units), for the share of the norm lost
# (Counts.lost_norm): taken at 2**-25, below which float16 rounds to zero. A bound for the values flushed there;
# those lost downstream of a flush (computed from flushed gradients) may be larger. Against float32
# (tests/underflow/test_underflow_float32_reference.py) it errs by at most a factor of 3 and takes the same side of the
# policy's 1% in every case there; a uniform density below 2**-25 (a third of it) missed the attention net's 2.8%
# at 2**16 (0.8%).
LOST_VALUE_SQUARE = (2.0**-25) ** 2


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


def judge(entries: list[Entry], rows: torch.Tensor, names: dict[int, str]) -> dict[str, Counts]:
    """The host's counts per module from a sample's rows (a CPU tensor, one row per entry, in the entries' order:
    :data:`~ampguard.underflow.gradients.ROW`), by the rule of this module's docstring."""
    if not entries:
        return {}
    slots = {key: index for index, key in enumerate(dict.fromkeys(entry.slot for entry in entries))}
    slot = torch.tensor([slots[entry.slot] for entry in entries])
    counted = torch.tensor([entry.counted for entry in entries])
    parameter = torch.tensor([entry.parameter for entry in entries])
    size = torch.tensor([entry.size for entry in entries], dtype=torch.int64)
    zeros, lowest, next_lowest, below_normal = rows[:, :4].long().unbind(1)
    peak, energy, sinking = rows[:, 4], rows[:, 5], rows[:, 6].long()
    normal = bool((counted & (peak >= SMALLEST_NORMAL)).any().tolist())  # (tolist: host tensors, not a device read)
    sunk_rows, fed_rows = lost_whole(entries, peak.tolist()) if normal else (set(), set())
    sunk, fed = torch.zeros(len(entries), dtype=torch.bool), torch.zeros(len(entries), dtype=torch.bool)
    sunk[list(sunk_rows)], fed[list(fed_rows)] = True, True
    # a parameter's gradient is computed from its module's output's: fed, and lost whole where all zero, where that
    # was flushed or lost whole
    flushing = counted & ~parameter & (((peak > 0) & (peak < SMALLEST_NORMAL)) | sunk)
    flushed_module = torch.zeros(len(slots), dtype=torch.int64).scatter_reduce_(0, slot, flushing.long(), "amax")
    fed |= parameter & flushed_module.bool()[slot]
    whole = peak == 0
    gone = whole & (sunk | fed | (not normal))
    # the zeros float32 would hold below 2**-25: half the values at 2**-24, times their ratio to those at 2**-23
    # where the density still rises toward zero; at most all zeros. In a gradient that was flushed or fed by a
    # flushed one, the zeros of its sinking columns are lost too (a qkv projection's queries and keys, flushed
    # inside the attention beside the values)
    estimate = lowest * torch.maximum(lowest, next_lowest) // (2 * next_lowest.clamp(min=1))
    sinks = (sinking > 0) & ((peak < SMALLEST_NORMAL) | fed)
    estimate = torch.where(sinks, sinking + torch.minimum(zeros - sinking, estimate), estimate)
    low = zeros + torch.minimum(zeros, estimate)
    none = torch.zeros_like(size)
    added = torch.stack([size, zeros, low, below_normal, none], dim=1)
    added = torch.where(whole.unsqueeze(1), torch.stack([size, size, size, size, none], dim=1), added)
    added = torch.where(gone.unsqueeze(1), torch.stack([size, none, none, none, size], dim=1), added)
    added = added * counted.unsqueeze(1)
    sums = torch.zeros(len(slots), 5, dtype=torch.int64).index_add_(0, slot, added)
    kept = torch.where(peak.isfinite(), peak, OVERFLOWED).masked_fill(~counted, 0.0)
    peaks = torch.zeros(len(slots), dtype=peak.dtype).scatter_reduce_(0, slot, kept, "amax").tolist()
    energies = torch.zeros(len(slots), dtype=energy.dtype).index_add_(0, slot, energy * counted).tolist()
    has_counted = torch.zeros(len(slots), dtype=torch.int64).index_add_(0, slot, counted.long()).tolist()
    totals_ = sums.tolist()
    modules: dict[str, Counts] = {}
    for key, index in slots.items():
        if not has_counted[index]:
            continue
        values, zeros_, low_, below, sunk_ = (int(value) for value in totals_[index])
        counts = Counts(values, zeros_, low_, below, sunk_, float(peaks[index]), float(energies[index]))
        name = names.get(key, "?")
        modules[name] = modules[name] + counts if name in modules else counts
    return modules


def _by_entry(order: list[int], values: list[float]) -> torch.Tensor:
    """The rows of ``values`` (flat, as many as ``order`` says first), in the order of the entries they are of."""
    rows = torch.tensor(values[: ROW * len(order)], dtype=torch.float64).view(len(order), ROW)
    by_entry = torch.empty_like(rows)
    by_entry[torch.tensor(order, dtype=torch.int64)] = rows
    return by_entry


def _sum(modules: dict[str, Counts]) -> Counts:
    total = Counts(energy=0.0)
    for counts in modules.values():
        total = total + counts
    return total


def judged_now(gradients: Gradients) -> dict[str, Counts]:
    """A sample's counts per module at once: reads its rows (on CUDA one synchronisation: for the sampled step of
    ranks training one model only, whose totals are exchanged at once)."""
    order, rows = gradients.rows()
    return judge(gradients.entries, _by_entry(order, rows.flatten().tolist()), gradients.names)


def totals(modules: dict[str, Counts], device: torch.device | None) -> torch.Tensor:
    """The modules' total in one float64 tensor, ``[values, zeros, low, below_normal, sunk, energy, peak]``, on
    ``device`` (the CPU where none; the peak last: the ranks take its maximum, and the sum of the others): what
    ranks exchange (:func:`ampguard.distributed.agree_on_underflow`). The same size whatever was counted."""
    device = device or torch.device("cpu")
    total = _sum(modules)
    energy = total.energy if math.isfinite(total.energy) else 0.0
    plain = [total.values, total.zeros, total.low, total.below_normal, total.sunk, energy, total.peak]
    return torch.tensor(plain, dtype=exact(device)).to(device, non_blocking=True)


class Transfer:
    """A sample's counts on their way to the host, known without a synchronisation.

    On CUDA a ``non_blocking`` copy into pinned memory and an event, polled by
    :attr:`ready` (:class:`~ampguard.syncs.HostCopy`); on the CPU the counts are
    host memory already. On another accelerator (no event to poll) :meth:`result`
    reads them (one counted read, on the step that finds the sample finished).
    Until then it holds the autograd nodes the gradients reached (not their saved
    tensors, freed by the backward pass): :meth:`result` judges the all-zero
    gradients from them (:mod:`ampguard.underflow.flushes`).

    ``total``: the ranks' totals (:func:`totals` agreed between them), which the
    measurement's total then is; its modules stay this rank's: ``modules``, where
    they were judged already (:func:`judged_now`), and then only ``total`` and
    ``extra`` travel.
    """

    def __init__(
        self,
        gradients: Gradients,
        step: int,
        scale: float,
        extra: torch.Tensor | None = None,
        total: torch.Tensor | None = None,
        modules: dict[str, Counts] | None = None,
    ) -> None:
        self.step, self.scale = step, scale
        self.agreed = total is not None
        self._modules = modules
        device = (
            gradients.device
            or (extra.device if extra is not None else None)
            or (total.device if total is not None else None)
            or torch.device("cpu")
        )
        kind = exact(device)
        pieces = [total.to(device, kind)] if total is not None else []
        self._order: list[int] = []
        self._entries: list[Entry] | None = None
        self._names: dict[int, str] = {}
        if modules is None:
            self._order, rows = gradients.rows(device)
            self._entries, self._names = gradients.entries, dict(gradients.names)
            pieces.append(rows.to(device, kind).flatten())
        if extra is not None:
            pieces.append(extra.to(device, kind).flatten())
        self._copy = HostCopy(torch.cat(pieces) if pieces else torch.zeros(0, dtype=kind, device=device))

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
        count = len(self._order)
        modules = self._modules
        if modules is None:
            entries, self._entries = self._entries or [], None  # (the nodes: no longer held)
            modules = judge(entries, _by_entry(self._order, values), self._names)
        total = Counts.read(*agreed[:5], agreed[6], agreed[5]) if agreed else _sum(modules)
        rest = values[ROW * count :]
        scale = rest[0] if math.isnan(self.scale) and rest else self.scale
        return Measurement(self.step, scale, total, modules), rest


def read(
    gradients: Gradients, step: int, scale: float, extra: torch.Tensor | None = None
) -> tuple[Measurement, list[float]]:
    """A sample's measurement at once, and the values of ``extra``.

    ``scale``: the loss scale the sampled step ran at (NaN: it is the first value of ``extra``).
    """
    return Transfer(gradients, step, scale, extra).result()
