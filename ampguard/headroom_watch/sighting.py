"""What one watched iteration saw: each candidate module's float16 peak, and the verdict, on the device.

A peak counts finite values only (a tensor holding +inf counts as 0: that
overflow is the probe's to find). An extreme within 1/16 of float16's limit,
either sign, is taken for a sentinel, not for a growing activation, and is not
counted: ``finfo(float16).min`` added to attention logits as a mask (-61,410 to
-65,504, or -inf), ``finfo(float16).max`` filled in where a minimum is taken
over the valid positions only (``h.masked_fill(~valid, finfo.max).amin(1)``).
A module that really grows is seen long before: the watch acts at
``65504 / AMPGUARD_HEADROOM`` (16,376 by default).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from ampguard.fp32_islands.probe import MAX_CALLS, qualified_name
from ampguard.syncs import HostCopy

FLOAT16_MAX = 65504.0
# An extreme this close to float16's limit, either sign, is a sentinel (a mask, finfo.min or finfo.max), not growth.
SENTINEL_BAND = FLOAT16_MAX * 15 / 16
# How many of the tightest modules scaler.stats shows.
SHOWN = 3
# A module's (min, max) pairs are folded into two every FOLD op outputs (:func:`fold`): a cell called thousands of
# times in one pass (a recurrent loop, a decoding loop) keeps a few 0-dim tensors, not two per op output per call.
FOLD = 32

Candidate = tuple[torch.nn.Module, torch.nn.Module, "tuple[str, ...] | None"]  # (module, its root, output dtypes)


@dataclass
class Sighting:
    """One watched iteration: the candidates' peaks and the verdict, on the device (and on its way to the host)."""

    modules: list[tuple[weakref.ref[torch.nn.Module], weakref.ref[torch.nn.Module]]]  # (module, its root)
    outputs: list[tuple[str, ...] | None]  # each candidate's output dtypes under autocast (for its island)
    verdict: torch.Tensor  # float32 scalar: index + 1 of the candidate within the headroom, 0 when none
    # [verdict, 1 if a watched float16 tensor held NaN or +inf, the verdict's peak, the SHOWN highest peaks, their
    # indices]
    summary: HostCopy
    step: int = 0  # the optimizer step whose forward passes were watched
    clean: bool = False  # its iteration had no forward overflow (set at its update)
    blamed: bool = False  # a forward overflow was blamed on what it saw (once per sighting)
    shown: tuple[tuple[str, float], ...] | None = None  # the tightest candidates, named, for scaler.stats
    overflowed: bool = False  # its pass held an overflow (known in device mode, where one read covers many steps)
    top: list[tuple[int, float]] = field(default_factory=list)  # (index, peak) of the tightest candidates
    verdict_peak: float = 0.0  # the peak of the verdict's candidate (the highest of those the verdict may name)

    def candidate(self, index: int) -> Candidate | None:
        """The ``index``-th candidate (0-based) while its module lives."""
        if not 0 <= index < len(self.modules):
            return None
        module, root = (ref() for ref in self.modules[index])
        return None if module is None or root is None else (module, root, self.outputs[index])

    def roots(self) -> list[torch.nn.Module]:
        """The living root modules (outermost calls) of the candidates, each once."""
        found = {id(root): root for root in (ref() for _, ref in self.modules) if root is not None}
        return list(found.values())

    def tightest(self) -> tuple[tuple[str, float], ...]:
        """The candidates with the highest peaks, named from their root (no read: see :class:`~ampguard.syncs.HostCopy`)."""
        if self.shown is None:
            self.read_verdict()
        return self.shown or ()

    def read_verdict(self) -> int:
        """The verdict, with the tightest candidates' peaks, from the host copy."""
        read = self.summary.values()
        count = (len(read) - 3) // 2
        self.overflowed = bool(read[1])
        self.verdict_peak = float(read[2])
        self.top = [(int(index), float(peak)) for peak, index in zip(read[3 : 3 + count], read[3 + count :])]
        shown = []
        for index, peak in self.top:
            found = self.candidate(index)
            name = qualified_name(found[0], found[1]) if found is not None else None
            if name:
                shown.append((name, float(peak)))
        self.shown = tuple(shown)
        return int(read[0])


def _per_output(lows: torch.Tensor, highs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each output's peak (finite values, sentinels not counted) and whether it held NaN or +inf."""
    nonfinite = lows.isnan() | highs.isnan() | (highs == float("inf"))
    below = (-lows).masked_fill(-lows >= SENTINEL_BAND, 0.0)
    above = highs.masked_fill(highs >= SENTINEL_BAND, 0.0)
    return torch.nan_to_num(torch.maximum(above, below), nan=0.0, posinf=0.0, neginf=0.0), nonfinite


def fold(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One module's (min, max) pairs as two that :func:`summarise` reads alike, on the device (no read).

    ``(0, peak)`` carries the peak (below the sentinel band, so exact in float16) and ``(NaN or 0, 0)`` whether
    any output held NaN or +inf; folded again with later pairs, they give the same peak and flag.
    """
    device = samples[0][0].device
    lows = torch.stack([low.to(device) for low, _ in samples]).float()
    highs = torch.stack([high.to(device) for _, high in samples]).float()
    peaks, nonfinite = _per_output(lows, highs)
    zero = torch.zeros((), dtype=torch.float16, device=device)
    flag = torch.where(nonfinite.any(), float("nan"), 0.0).to(torch.float16)
    return [(zero, peaks.amax().to(torch.float16)), (flag, zero)]


def summarise(
    samples: list[list[tuple[torch.Tensor, torch.Tensor]]],
    modules: list[tuple[weakref.ref[torch.nn.Module], weakref.ref[torch.nn.Module]]],
    outputs: list[tuple[str, ...] | None],
    limit: float,
    step: int,
    eligible: list[bool] | None = None,
) -> Sighting:
    """The sighting of one pass: ``samples[i]`` holds the (min, max) of each float16 output of candidate ``i``.

    ``eligible[i]``: whether the verdict may name candidate ``i`` (False: already named in report mode, which
    changes nothing, so it would stay the verdict of every watch and hide the next module). Every candidate's peak
    is shown and may be blamed all the same. None: all may.
    """
    device = samples[0][0][0].device
    lows = torch.stack([low.to(device) for per_module in samples for low, _ in per_module]).float()
    highs = torch.stack([high.to(device) for per_module in samples for _, high in per_module]).float()
    per_output, nonfinite_outputs = _per_output(lows, highs)
    nonfinite = nonfinite_outputs.any().float()
    each = [part.amax() for part in per_output.split([len(per_module) for per_module in samples])]
    peaks = torch.stack(each)
    values, order = peaks.topk(min(SHOWN, len(samples)))
    best, at = values[0], order[0]
    if eligible is not None and not all(eligible):  # chosen on the host: no index tensor copied to the device
        best, at = torch.stack([p if ok else torch.zeros_like(p) for p, ok in zip(each, eligible)]).max(0)
    fits = best >= limit
    if len(samples) > MAX_CALLS:  # the verdict must fit its bits of the scaler's read
        fits = fits & (at < MAX_CALLS)
    verdict = torch.where(fits, at + 1, 0).float()
    head = [verdict.reshape(1), nonfinite.reshape(1), best.reshape(1)]
    summary = HostCopy(torch.cat([*head, values, order.float()]))
    return Sighting(modules, outputs, verdict, summary, step=step)
