"""What every patch is: a name, a one-line summary, a torch version gate, apply() and revert()."""

from __future__ import annotations

from typing import ClassVar

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ampguard.bindings import Bindings
from ampguard.config import Config


def torch_release(version: str | None = None) -> Version:
    """torch's version reduced to its release numbers.

    ``2.4.0a0+git1234``, ``2.4.0.dev20240501``, ``2.4.0rc1`` and ``2.4.0+cu121``
    all become ``2.4.0``, so a nightly or a local build gates like its release
    (plain ``Version("2.4.0a0") >= Version("2.4")`` is False).
    """
    if version is None:
        import torch

        version = torch.__version__
    return Version(".".join(str(part) for part in Version(str(version)).release))


class Patch:
    """One change to torch, applied and reverted as a unit.

    Subclasses set the class attributes and implement :meth:`apply`, making every
    change through ``self.bindings`` so that the default :meth:`revert` can undo
    it. ``apply`` raises :class:`~ampguard.errors.PatchUnavailable` with a reason
    when the patch cannot apply on this torch.
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    requires_torch: ClassVar[str] = ""
    opt_in: ClassVar[bool] = False

    def __init__(self) -> None:
        self.bindings = Bindings(self.name)

    def supports(self, torch_version: str | None = None) -> bool:
        return not self.requires_torch or torch_release(torch_version) in SpecifierSet(self.requires_torch)

    def apply(self, config: Config) -> None:
        raise NotImplementedError

    def revert(self) -> None:
        self.bindings.undo()
