"""What one selftest check found, and the run it belongs to (:class:`Context`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

Status = Literal["passed", "failed", "not applicable"]


@dataclass(frozen=True)
class CheckResult:
    """One check: its ``status``, the value measured under ampguard, the ``reference`` it was compared with, and why.

    ``measured`` and ``reference`` are plain JSON data (numbers, strings, lists, dicts). ``ampguard_errors``:
    ampguard's own errors during the check, contained (:mod:`.faults`); any makes the check fail.
    """

    name: str
    status: Status
    measured: Any
    reference: Any
    detail: str
    seconds: float = 0.0
    ampguard_errors: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "passed": self.passed,
            "detail": self.detail,
            "measured": self.measured,
            "reference": self.reference,
            "seconds": round(self.seconds, 3),
            "ampguard_errors": list(self.ampguard_errors),
        }


def verdict(name: str, ok: bool, measured: Any, reference: Any, detail: str) -> CheckResult:
    return CheckResult(name, "passed" if ok else "failed", measured, reference, detail)


def not_applicable(name: str, why: str, measured: Any = None, reference: Any = None) -> CheckResult:
    return CheckResult(name, "not applicable", measured, reference, why)


def not_ampguards(name: str, scaler: Any) -> CheckResult | None:
    """A failure when ``scaler`` (an instance, or the class ``torch.amp.GradScaler`` is now) is not ampguard's."""
    from ampguard.scaler.safe import SafeGradScaler

    cls = scaler if isinstance(scaler, type) else type(scaler)
    if issubclass(cls, SafeGradScaler):
        return None
    return verdict(
        name, False, cls.__qualname__, "SafeGradScaler", "torch.amp.GradScaler(...) is not ampguard's scaler"
    )


@dataclass(frozen=True)
class Context:
    """Where the checks train (``device``) and how long (``quick``: fewer steps)."""

    device: torch.device
    quick: bool = False

    def steps(self, full: int, quick: int) -> int:
        return quick if self.quick else full

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """float16 autocast on the device (float16 on CPU too: that is the dtype the checks are about)."""
        return torch.autocast(self.device.type, dtype=torch.float16)

    def tensor(self, *shape: int, generator: torch.Generator) -> torch.Tensor:
        """Random data drawn on the host (the same numbers on every device), then moved to the device."""
        return torch.randn(*shape, generator=generator).to(self.device)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """``torch.manual_seed(seed)`` for a model's initial weights, the global RNG state restored afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
