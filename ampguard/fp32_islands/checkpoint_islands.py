"""The islands a checkpoint names, re-applied at the first module call after it is loaded.

The scaler's ``state_dict()["ampguard"]`` carries the islands' names, qualified
from the top-level module, and the dtypes their outputs had under autocast
(:class:`~ampguard.fp32_islands.patch.IslandsListener`). Loading it asks
:meth:`CheckpointIslands.restore`, which arms a one-shot global forward
pre-hook: at the next module call each name is looked up in the models being
trained and made an island there; names found nowhere are reported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.nn.modules import module as nn_module

import ampguard.fp32_islands.model_tree as model_tree
from ampguard.fp32_islands.probe import qualified_name, unwrap
from ampguard.log import event_logger
from ampguard.module_hooks import eager_only

if TYPE_CHECKING:
    from ampguard.fp32_islands.islands import Islands

logger = event_logger("island")

NOT_LOOKED_UP = (
    "the checkpoint names fp32 islands %s, but no module was called outside compiled code in the first iteration "
    "after loading (islands do not apply inside torch.compile'd code): not re-applied (ampguard names an island "
    "again at its next forward overflow)."
)


class CheckpointIslands:
    """The islands named by the checkpoints loaded since the last module call, waiting to be re-applied."""

    def __init__(self, islands: Islands) -> None:
        self.islands = islands
        self._names: list[str] = []
        self._outputs: dict[str, tuple[str, ...]] = {}
        self._full_names = True
        self._handle: Any = None  # the one-shot global pre-hook, while names wait

    def restore(self, saved: Any, outputs: Any = None, *, full_names: bool) -> None:
        """Re-apply the islands named in a checkpoint at the next forward pass (a one-shot global pre-hook).

        ``outputs``: the checkpoint's recorded output dtypes by name (absent in checkpoints of earlier versions).
        ``full_names``: the names are qualified from the top-level module (checkpoints
        of this version). Earlier ones are relative to the outermost module called
        then; such a name is looked up as the end of a full name, and re-applied only
        where it names exactly one module.
        """
        present = self.islands.names()
        wanted = [str(name) for name in saved or () if str(name) and str(name) not in present]
        if not wanted:
            return
        if self._handle is not None:  # another scaler's checkpoint (a GAN's): both are looked up
            full_names = full_names and self._full_names
            wanted = list(dict.fromkeys([*self._names, *wanted]))
        else:
            self._outputs = {}
        self._names = wanted
        self._outputs.update(
            (str(name), tuple(str(kind) for kind in kinds))
            for name, kinds in (outputs.items() if isinstance(outputs, dict) else ())
            if isinstance(kinds, (list, tuple))
        )
        self._full_names = full_names
        if self._handle is None:
            self._handle = nn_module.register_module_forward_pre_hook(
                # a plain function that returns at once while dynamo traces it: the first eager call looks up
                eager_only(self.restore_into)
            )

    def restoring(self) -> bool:
        """Whether names of a checkpoint wait for the next module call."""
        return self._handle is not None

    def end_window(self) -> None:
        """At the end of the first iteration after loading: names never looked up (no module was called) are
        reported."""
        if self._handle is None:
            return
        left = self._names
        self.stop()
        if left:
            logger.warning(NOT_LOOKED_UP, ", ".join(left))

    def stop(self) -> None:
        """Nothing waits any more (the hook removed)."""
        handle, self._handle = self._handle, None
        self._names = []
        self._outputs = {}
        if handle is not None:
            handle.remove()

    def restore_into(self, module: torch.nn.Module, args: Any) -> None:
        """At the first module call after loading: each name in the models being trained.

        Looked up first in the top-level module above the module called, when an
        optimizer trains its parameters, then in every other top-level module whose
        parameters an optimizer trains (a GAN's other model; the first call may be
        to a module outside the models: data augmentation, a loss).
        """
        names, outputs, legacy = self._names, self._outputs, not self._full_names
        self.stop()
        try:
            tree = model_tree.scan()
            called = tree.top_level(module)
            first = [called] if tree.holds_trained(called) else []
            others = [top for top in tree.trained_tops() if top is not called] or ([] if first else [called])
            left = []
            for saved in names:
                tops = first
                found = _find(saved, first, legacy)
                if not found:
                    tops = others
                    found = _find(saved, others, legacy)
                if not found:
                    left.append(saved)
                    continue
                if len(found) > 1:
                    _ambiguous(saved, found, tops)
                    continue
                target = found[0]
                name = qualified_name(target, tree.top_level(target, called=called)) or saved
                self.islands.make(target, name, outputs.get(saved))
                logger.info("fp32 island %s (%s) re-applied from the checkpoint.", name, type(target).__name__)
            _report_unresolved(left)
        except Exception as error:
            logger.warning("ampguard could not re-apply fp32 islands from the checkpoint (%r).", error)


def _find(name: str, tops: list[torch.nn.Module], legacy: bool) -> list[torch.nn.Module]:
    """The modules ``name`` names in ``tops``: the full name, or (``legacy``) a full name ending with it.

    A full name is looked up in the model inside a wrapper, then in the wrapper
    itself (names saved before :func:`unwrap` saw through it: Fabric's ``_forward_module.``).
    """
    found: dict[int, torch.nn.Module] = {}
    for top in tops:
        for holder in (unwrap(top), top):
            try:
                target = holder.get_submodule(name)
            except AttributeError:
                continue
            found[id(target)] = target
            break
    if not found and legacy:
        for top in tops:
            for full, target in unwrap(top).named_modules():
                if full.endswith("." + name):
                    found[id(target)] = target
    return list(found.values())


def _ambiguous(saved: str, found: list[torch.nn.Module], tops: list[torch.nn.Module]) -> None:
    full = sorted({name for target in found for top in tops if (name := qualified_name(target, top))})
    logger.warning(
        "the checkpoint names fp32 island %s, which could be any of %d modules of the models being trained (%s): "
        "not re-applied (ampguard names it again at its next forward overflow).",
        saved,
        len(found),
        ", ".join(full[:4]) + (", ..." if len(full) > 4 else ""),
    )


def _report_unresolved(left: list[str]) -> None:
    if left:
        logger.warning(
            "the checkpoint names fp32 islands %s, but the models being trained have no such module: not re-applied.",
            ", ".join(left),
        )
