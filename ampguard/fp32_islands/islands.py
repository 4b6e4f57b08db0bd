"""fp32 islands: a module that overflowed float16 in the forward pass runs in float32 from then on.

An island is one module *instance* with two hooks (:mod:`ampguard.fp32_islands.island_hooks`): a forward
pre-hook that casts the floating-point inputs on the autocast device to float32
(in any nesting: namedtuples, dataclasses, ``ModelOutput``) and enters
``torch.autocast(device, enabled=False)``, and a forward hook (``always_call=True``,
so an exception still leaves the region) that exits it and gives the floating
outputs the dtypes they had under autocast (:mod:`ampguard.fp32_islands.island_io`). That is
``torch.amp.custom_fwd(cast_inputs=torch.float32)`` with the caller's dtypes
kept; the parameters are untouched (float16/bfloat16 ones are read as float32
copies for the length of each call: :mod:`ampguard.fp32_islands.half_parameters`).
Modules that are not islands, and models
that never overflow, carry no hook at all.

:func:`decide` turns a probe verdict into an island, or into a report when an
island cannot help or cannot be made: the root module itself (the overflow is in
code no submodule owns), a compiled model (its inside is not seen), a
TorchScript module (it takes no hooks), the
``AMPGUARD_MAX_ISLANDS`` limit, or ``AMPGUARD_FP32_ISLANDS=report``.

The islands of one application of the patch are an :class:`Islands`, which the
healing holds (they belong to modules, not to a scaler), keyed by module
instance (:mod:`ampguard.fp32_islands.island_hooks`: a deepcopy'd EMA or
teacher and its student have islands of their own). Each is named from the
top-level module (the object the user holds, with
the parameters the optimizer trains: :mod:`ampguard.fp32_islands.model_tree`), so that the
printed ``model.get_submodule(name)`` works on it. The names ride in the
scaler's ``state_dict()["ampguard"]["fp32_islands"]`` (their output dtypes in
``["fp32_island_outputs"]``), and :class:`~ampguard.fp32_islands.checkpoint_islands.CheckpointIslands`
re-applies them, by that full name, at the next forward after loading.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

import ampguard.fp32_islands.island_hooks as island_hooks
import ampguard.fp32_islands.island_io as island_io
import ampguard.fp32_islands.model_tree as model_tree
import ampguard.messages as messages
from ampguard.fp32_islands.checkpoint_islands import CheckpointIslands
from ampguard.fp32_islands.compiled_islands import CompiledIslands
from ampguard.fp32_islands.half_parameters import LOW_PRECISION
from ampguard.fp32_islands.island_hooks import Island, IslandTable, device_type_of
from ampguard.fp32_islands.probe import is_compiled, qualified_name, unwrap
from ampguard.log import event_logger

logger = event_logger("island")

MADE_WITHOUT_AUTOCAST = (
    "fp32 island: {name} ({cls}) overflowed float16 in the forward pass (inf/NaN output from finite inputs, "
    "step {step}). From now on it runs in float32: the model runs without autocast, so its floating-point inputs "
    "are cast to float32 and its outputs given back in the dtypes they had; {parameters}. To make this permanent "
    "without ampguard (model: your {owner}): {line}"
)


class Islands(IslandTable):
    """The fp32 islands of one application of the patch: made, named, taken back, reported, restored.

    Example (what the healing does with a probe's verdict)::

        islands = Islands()
        if islands.decide(module, root, outputs, step=12, mode="auto", max_islands=8):
            ...  # ``module`` runs in float32 from its next call on
        islands.names()  # ("blocks.1.attn",)
    """

    def __init__(self) -> None:
        super().__init__()
        self.reported: set[str] = set()  # the names (and "(limit)") reported once
        # The modules named in report mode (which changes nothing): the headroom watch's verdict passes over them,
        # as over an island in auto mode, so the next module auto mode would make an island is named too.
        self.named_in_report: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        # Islands made on the headroom watch's blame alone (the module was the closest to the limit, not seen to
        # overflow): taken back when the next module the forward run again or the probe names is another one.
        self._blamed: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self.compiled = CompiledIslands(self)
        self.checkpoint = CheckpointIslands(self)

    def _live(self) -> list[Island]:
        return [
            island
            for key, island in self.by_module.items()
            if island.module() is not None and id(island.module()) == key
        ]

    def names(self) -> tuple[str, ...]:
        """The names of the islands whose module is alive, in the order they were made (a model and its copy:
        once)."""
        return tuple(dict.fromkeys(island.name for island in self._live()))

    def holds(self, module: torch.nn.Module) -> bool:
        """Whether ``module`` is an island."""
        return self.of(module) is not None

    def was_named_in_report(self, module: torch.nn.Module) -> bool:
        """Whether ``module`` was named in report mode (``AMPGUARD_FP32_ISLANDS=report``), where it stays as it
        was."""
        return module in self.named_in_report

    def make(self, module: torch.nn.Module, name: str, outputs: tuple[str, ...] | None = None) -> Island:
        """Run ``module`` in float32 from its next call on (idempotent per module instance).

        ``name``: its name from the top-level module, for messages and checkpoints
        (a deepcopy of the model has the same names, and islands of its own).
        ``outputs``: the dtypes its floating outputs had under autocast, which the
        island gives them again (see :mod:`ampguard.fp32_islands.island_io`); None leaves them float32.
        """
        existing = self.of(module)
        if existing is not None:
            if outputs is not None:
                existing.outputs = outputs
            return existing
        _remove(self.by_module.pop(id(module), None))  # a dead module's entry under a reused id
        island = Island(name, weakref.ref(module), outputs=outputs)
        island_hooks.attach(module, island, self)
        self.by_module[id(module)] = island
        self.compiled.listen()
        return island

    def mark_blamed(self, module: torch.nn.Module) -> None:
        """``module``'s island was made on a blame alone (:mod:`~ampguard.fp32_islands.watch_verdicts`): until the
        next module named, it is taken back if that is another one (:meth:`settle_blame`)."""
        self._blamed.add(module)

    def settle_blame(self, named: torch.nn.Module, root: torch.nn.Module, step: int) -> None:
        """The forward run again or the probe named ``named`` at a forward overflow: the islands made on a blame
        alone are kept when it is theirs, and taken back otherwise (the overflow came back, from another module).

        Called before ``named``'s island is decided, so the slot a wrong blame took counts for it
        (``AMPGUARD_MAX_ISLANDS``).
        """
        for module in list(self._blamed):
            self._blamed.discard(module)
            island = self.of(module)
            if module is named or island is None:
                continue
            _remove(self.by_module.pop(id(module), None))
            other = qualified_name(named, root) or type(unwrap(root)).__name__
            logger.warning(
                messages.ISLAND_TAKEN_BACK.format(name=island.name, cls=type(module).__name__, step=step, other=other)
            )

    def recorded_outputs(self) -> dict[str, list[str]]:
        """The output dtypes recorded for the live islands, by name (plain strings, for checkpoints)."""
        return {island.name: list(island.outputs) for island in self._live() if island.outputs is not None}

    def clear(self) -> None:
        """Remove every island, the hooks copies of the models carry, and forget what was reported (uninstall)."""
        for island in list(self.by_module.values()):
            _remove(island)
        self.by_module.clear()
        island_hooks.strip_everywhere()
        self.compiled.stop()
        self.reported.clear()
        self.named_in_report.clear()
        self._blamed.clear()
        self.checkpoint.stop()

    def decide(
        self,
        module: torch.nn.Module,
        root: torch.nn.Module,
        outputs: tuple[str, ...] | None = None,
        *,
        step: int,
        mode: str,
        max_islands: int,
        made: str = messages.ISLAND_MADE,
        reported: str = messages.ISLAND_REPORT,
        limited: str = messages.ISLAND_LIMIT,
        **details: Any,
    ) -> bool:
        """Make ``module`` an island, or report why not (each name once). True when a new island was made.

        ``root`` is the outermost module the forward pass called; the name is
        qualified from the top-level module above it (:mod:`ampguard.fp32_islands.model_tree`).
        ``outputs``: the dtypes of its floating outputs the probe saw under autocast.
        ``made`` / ``reported`` / ``limited``: the messages for an island made /
        named in report mode / refused at the limit (the headroom watch's own),
        formatted with ``details`` too.
        """
        if self.holds(module):
            self._report_unhelpful(module, step)
            return False
        top = _top_level(module, root)
        name = None if module is root or module is unwrap(root) else qualified_name(module, top)
        label = name or type(unwrap(root)).__name__
        device_type = device_type_of(module, ())
        cls = str(getattr(module, "original_name", "")) or type(module).__name__  # a ScriptModule's own class
        low = sorted({str(p.dtype).replace("torch.", "") for p in module.parameters() if p.dtype in LOW_PRECISION})
        stored_in = island_io.stored_without_autocast(outputs)
        line = permanent_line(name or "", device_type, half=bool(low), stored_in=stored_in)
        if stored_in is not None and made is messages.ISLAND_MADE:
            made = MADE_WITHOUT_AUTOCAST
        what = {"name": label, "cls": cls, "step": step, "line": line, "owner": type(unwrap(top)).__name__, **details}
        what["parameters"] = (
            f"its {'/'.join(low)} parameters stay {'/'.join(low)} (upcast to float32 for each of its forward calls only)"
            if low
            else "its parameters are unchanged"
        )
        if name is None or name == "":
            self._report_once(label, messages.ISLAND_ROOT.format(**what))
            if is_compiled(root):
                self._report_once(label + " (compiled)", messages.ISLAND_COMPILED.format(**what))
            return False
        if is_compiled(root):
            self._report_once(name, messages.ISLAND_COMPILED.format(**what))
            return False
        if isinstance(module, torch.jit.ScriptModule):  # takes no hooks: making it an island would raise
            self._report_once(name, messages.ISLAND_SCRIPTED.format(**what))
            return False
        if mode == "report":
            self._report_once(name, reported.format(**what))
            self.named_in_report.add(module)
            return False
        if len(self.names()) >= max_islands:
            self._report_once("(limit)", limited.format(limit=max_islands, names=", ".join(self.names()), **what))
            return False
        self.make(module, name, outputs)
        logger.warning(made.format(**what))
        return True

    def _report_unhelpful(self, module: torch.nn.Module, step: int) -> None:
        """The probe named an island again: float32 does not fix its overflow (said once per island)."""
        island = self.of(module)
        if island is not None and not island.unhelpful_reported:
            island.unhelpful_reported = True
            logger.warning(messages.ISLAND_UNHELPFUL.format(name=island.name, cls=type(module).__name__, step=step))

    def _report_once(self, key: str, message: str) -> None:
        if key not in self.reported:
            self.reported.add(key)
            logger.warning(message)


def _remove(island: Island | None) -> None:
    if island is not None:
        for handle in island.handles:
            handle.remove()


def permanent_line(name: str, device_type: str, half: bool = False, stored_in: str | None = None) -> str:
    """The one line that makes an island permanent without ampguard (``model`` is the user's model).

    ``half``: the module has float16/bfloat16 parameters. Without ampguard nothing
    upcasts them at each call, so the line keeps that module's weights in float32.
    ``stored_in``: the model runs without autocast, stored in this dtype (``"float16"``): the line casts the
    inputs to float32 and the (tensor) output back itself, as no autocast does.
    """
    get = f'model.get_submodule("{name}")' + ("; m.float()" if half else "")
    if stored_in is not None:
        cast_in = (
            "lambda m, args: tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)"
        )
        return (
            f"m = {get}; m.register_forward_pre_hook({cast_in}); "
            f"m.register_forward_hook(lambda m, args, out: out.to(torch.{stored_in}))"
        )
    # custom_fwd sets attributes on args[0]: wrapping the class's forward and binding it makes that the module,
    # so that a call with keyword arguments only (or a first argument that is not a tensor) works too.
    if hasattr(torch.amp, "custom_fwd"):  # torch >= 2.4
        wrapped = f'torch.amp.custom_fwd(type(m).forward, device_type="{device_type}", cast_inputs=torch.float32)'
        wrapped += ".__get__(m)"
    elif device_type == "cuda":
        wrapped = "torch.cuda.amp.custom_fwd(type(m).forward, cast_inputs=torch.float32).__get__(m)"
    else:  # no custom_fwd for this device: autocast off inside, and the caller passes float32 inputs
        wrapped = f'torch.autocast("{device_type}", enabled=False)(m.forward)'
    return f"m = {get}; m.forward = {wrapped}"


def _top_level(module: torch.nn.Module, root: torch.nn.Module) -> torch.nn.Module:
    """The module the user holds above ``module`` (one scan of live objects: a verdict is the failure path)."""
    try:
        return model_tree.scan().top_level(module, called=root)
    except Exception:  # the names of before: relative to the outermost module called
        return root
