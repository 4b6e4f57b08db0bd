"""What every patch is: a name, a one-line summary, a torch version gate, apply() and revert()."""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from typing import Any, ClassVar

try:  # torch's own copy of packaging, which `import torch` has loaded: importing packaging.version costs ~4 ms more
    from torch._vendor.packaging.version import Version
except ImportError:  # a torch without it
    from packaging.version import Version  # type: ignore[assignment]

from ampguard.bindings import Bindings
from ampguard.config import Config
from ampguard.torch_privates import Private


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


_SIMPLE_CLAUSE = re.compile(r"\s*(>=|<=|==|!=|>|<)\s*(\d+(?:\.\d+)*)\s*")
_COMPARE: dict[str, Callable[[Any, Any], Any]] = {
    ">=": operator.ge,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
    ">": operator.gt,
    "<": operator.lt,
}


def release_in(release: Version, specifiers: str) -> bool:
    """``release in SpecifierSet(specifiers)`` for a version of release numbers only (see :func:`torch_release`).

    Clauses like ``>=2.3`` or ``>=2.3,<2.15`` are compared as zero-padded
    release tuples, which is what PEP 440 does for such versions; anything
    else (``~=``, wildcards, local labels) goes to ``packaging.specifiers``,
    imported only then: importing it costs more than all of ampguard's patches.
    """
    clauses = [_SIMPLE_CLAUSE.fullmatch(clause) for clause in specifiers.split(",")]
    if release.pre or release.post or release.dev or release.local or not all(clauses):
        from packaging.specifiers import SpecifierSet

        return SpecifierSet(specifiers).contains(str(release))  # str: either packaging's Version
    for match in clauses:
        assert match is not None
        wanted = tuple(int(part) for part in match.group(2).split("."))
        width = max(len(wanted), len(release.release))
        have = release.release + (0,) * (width - len(release.release))
        if not _COMPARE[match.group(1)](have, wanted + (0,) * (width - len(wanted))):
            return False
    return True


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
    # torch internals the patch relies on: checked at install (ampguard.torch_privates)
    requires_privates: ClassVar[tuple[Private, ...]] = ()
    opt_in: ClassVar[bool] = False

    def __init__(self) -> None:
        self.bindings = Bindings(self.name)

    def supports(self, torch_version: str | None = None) -> bool:
        return not self.requires_torch or release_in(torch_release(torch_version), self.requires_torch)

    def apply(self, config: Config) -> None:
        raise NotImplementedError

    def revert(self) -> None:
        self.bindings.undo()
