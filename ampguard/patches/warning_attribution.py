"""torch's warnings from inside a function ampguard wraps point where they point under plain torch.

torch issues its warnings with ``stacklevel=2``: at the line that called the
warning function (``autocast.__init__``, ``GradScaler.__init__`` or ``step``,
``LRScheduler.step``). When ampguard wraps that function, the caller is
ampguard's wrapper, and the warning would name a line of ampguard's files
(and, counted against that line, print once for every caller together).

:class:`AttributingWarnings` stands in for the ``warnings`` module in the
namespace of such a torch module (:func:`attribute_past_ampguard`). Its
``warn`` moves the attribution past ampguard's frames, to the first frame
outside ampguard, and hands the call to :func:`warnings.warn`: the filters,
the once-per-line registry and the text are Python's, as under plain torch.
Catching the warnings (``warnings.catch_warnings``) and issuing them again
would not do: entering and leaving it resets every module's record of the
warnings it showed, so a warning shown once per line would print again.
Costs nothing until torch warns.
"""

from __future__ import annotations

import os
import sys
import types
import warnings
from typing import Any

from ampguard.bindings import Bindings

_PACKAGE_DIRECTORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # ampguard/


def _in_ampguard(frame: types.FrameType) -> bool:
    return frame.f_code.co_filename.startswith(_PACKAGE_DIRECTORY)


class AttributingWarnings(types.ModuleType):
    """The ``warnings`` module, whose ``warn`` attributes a warning to the first frame outside ampguard."""

    def __init__(self) -> None:
        super().__init__("warnings", warnings.__doc__)

    def __getattr__(self, name: str) -> Any:
        return getattr(warnings, name)

    @staticmethod
    def warn(
        message: Warning | str, category: type[Warning] | None = None, stacklevel: int = 1, *args: Any, **options: Any
    ) -> None:
        level = max(stacklevel, 1)
        try:
            frame: types.FrameType | None = sys._getframe(level)  # 1: the caller of warn, as for warnings.warn
        except ValueError:  # a stack shallower than stacklevel: Python's own handling
            frame = None
        while frame is not None and _in_ampguard(frame):
            frame = frame.f_back
            level += 1
        warnings.warn(message, category, level + 1, *args, **options)  # + 1: this frame


def attribute_past_ampguard(bindings: Bindings, module: types.ModuleType) -> None:
    """Make ``module``'s warnings (``warnings.warn(...)`` in its code) skip ampguard's frames; undone with ``bindings``."""
    if getattr(module, "warnings", None) is warnings:
        bindings.set_attribute(module, "warnings", AttributingWarnings())
