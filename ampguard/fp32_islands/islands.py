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

Islands are process state (they belong to modules, not to a scaler), keyed by
module instance (:mod:`ampguard.fp32_islands.island_hooks`: a deepcopy'd EMA or
teacher and its student have islands of their own). Each is named from the
top-level module (the object the user holds, with
the parameters the optimizer trains: :mod:`ampguard.fp32_islands.model_tree`), so that the
printed ``model.get_submodule(name)`` works on it. The names ride in the
scaler's ``state_dict()["ampguard"]["fp32_islands"]`` (their output dtypes in
``["fp32_island_outputs"]``), and :func:`restore` re-applies them, by that full
name, at the next forward after loading.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.nn.modules import module as nn_module

import ampguard.fp32_islands.compiled_islands as compiled_islands
import ampguard.fp32_islands.island_hooks as island_hooks
import ampguard.fp32_islands.island_io as island_io
import ampguard.fp32_islands.model_tree as model_tree
import ampguard.messages as messages
from ampguard.fp32_islands.half_parameters import LOW_PRECISION
from ampguard.fp32_islands.island_hooks import Island, device_type_of
from ampguard.fp32_islands.probe import is_compiled, qualified_name, unwrap
from ampguard.log import event_logger

logger = event_logger("island")

islands = island_hooks.islands
MADE_WITHOUT_AUTOCAST = (
    "fp32 island: {name} ({cls}) overflowed float16 in the forward pass (inf/NaN output from finite inputs, "
    "step {step}). From now on it runs in float32: the model runs without autocast, so its floating-point inputs "
    "are cast to float32 and its outputs given back in the dtypes they had; {parameters}. To make this permanent "
    "without ampguard (model: your {owner}): {line}"
)
reported: set[str] = set()
# The modules named in report mode (which changes nothing): the headroom watch's verdict passes over them, as over
# an island in auto mode, so the next module auto mode would make an island is named too.
named_in_report: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
# Islands made on the headroom watch's blame alone (the module was the closest to the limit, not seen to overflow):
# taken back when the next module the forward run again or the probe names is another one.
_blamed: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
_pending: dict[str, Any] = {"names": [], "outputs": {}, "handle": None, "full_names": True}


def _live() -> list[Island]:
    return [island for key, island in islands.items() if island.module() is not None and id(island.module()) == key]


def names() -> tuple[str, ...]:
    """The names of the islands whose module is alive, in the order they were made (a model and its copy: once)."""
    return tuple(dict.fromkeys(island.name for island in _live()))


def holds(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an island."""
    return island_hooks.island_of(module) is not None


def was_named_in_report(module: torch.nn.Module) -> bool:
    """Whether ``module`` was named in report mode (``AMPGUARD_FP32_ISLANDS=report``), where it stays as it was."""
    return module in named_in_report


def make(module: torch.nn.Module, name: str, outputs: tuple[str, ...] | None = None) -> Island:
    """Run ``module`` in float32 from its next call on (idempotent per module instance).

    ``name``: its name from the top-level module, for messages and checkpoints
    (a deepcopy of the model has the same names, and islands of its own).
    ``outputs``: the dtypes its floating outputs had under autocast, which the
    island gives them again (see :mod:`ampguard.fp32_islands.island_io`); None leaves them float32.
    """
    existing = island_hooks.island_of(module)
    if existing is not None:
        if outputs is not None:
            existing.outputs = outputs
        return existing
    _remove(islands.pop(id(module), None))  # a dead module's entry under a reused id
    island = Island(name, weakref.ref(module), outputs=outputs)
    island_hooks.attach(module, island)
    islands[id(module)] = island
    compiled_islands.listen()
    return island


def mark_blamed(module: torch.nn.Module) -> None:
    """``module``'s island was made on a blame alone (:mod:`~ampguard.fp32_islands.watch_verdicts`): until the next
    module named, it is taken back if that is another one (:func:`settle_blame`)."""
    _blamed.add(module)


def settle_blame(named: torch.nn.Module, root: torch.nn.Module, step: int) -> None:
    """The forward run again or the probe named ``named`` at a forward overflow: the islands made on a blame alone
    are kept when it is theirs, and taken back otherwise (the overflow came back, from another module).

    Called before ``named``'s island is decided, so the slot a wrong blame took counts for it
    (``AMPGUARD_MAX_ISLANDS``).
    """
    for module in list(_blamed):
        _blamed.discard(module)
        island = island_hooks.island_of(module)
        if module is named or island is None:
            continue
        _remove(islands.pop(id(module), None))
        other = qualified_name(named, root) or type(unwrap(root)).__name__
        logger.warning(
            messages.ISLAND_TAKEN_BACK.format(name=island.name, cls=type(module).__name__, step=step, other=other)
        )


def recorded_outputs() -> dict[str, list[str]]:
    """The output dtypes recorded for the live islands, by name (plain strings, for checkpoints)."""
    return {island.name: list(island.outputs) for island in _live() if island.outputs is not None}


def _remove(island: Island | None) -> None:
    if island is not None:
        for handle in island.handles:
            handle.remove()


def clear() -> None:
    """Remove every island, the hooks copies of the models carry, and forget what was reported (uninstall)."""
    for island in list(islands.values()):
        _remove(island)
    islands.clear()
    island_hooks.strip_everywhere()
    compiled_islands.stop()
    reported.clear()
    named_in_report.clear()
    _blamed.clear()
    _stop_restoring()


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


def decide(
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
    if holds(module):
        _report_unhelpful(module, step)
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
        _report_once(label, messages.ISLAND_ROOT.format(**what))
        if is_compiled(root):
            _report_once(label + " (compiled)", messages.ISLAND_COMPILED.format(**what))
        return False
    if is_compiled(root):
        _report_once(name, messages.ISLAND_COMPILED.format(**what))
        return False
    if isinstance(module, torch.jit.ScriptModule):  # takes no hooks: making it an island would raise
        _report_once(name, messages.ISLAND_SCRIPTED.format(**what))
        return False
    if mode == "report":
        _report_once(name, reported.format(**what))
        named_in_report.add(module)
        return False
    if len(names()) >= max_islands:
        _report_once("(limit)", limited.format(limit=max_islands, names=", ".join(names()), **what))
        return False
    make(module, name, outputs)
    logger.warning(made.format(**what))
    return True


def _report_unhelpful(module: torch.nn.Module, step: int) -> None:
    """The probe named an island again: float32 does not fix its overflow (said once per island)."""
    island = island_hooks.island_of(module)
    if island is not None and not island.unhelpful_reported:
        island.unhelpful_reported = True
        logger.warning(messages.ISLAND_UNHELPFUL.format(name=island.name, cls=type(module).__name__, step=step))


def _top_level(module: torch.nn.Module, root: torch.nn.Module) -> torch.nn.Module:
    """The module the user holds above ``module`` (one scan of live objects: a verdict is the failure path)."""
    try:
        return model_tree.scan().top_level(module, called=root)
    except Exception:  # the names of before: relative to the outermost module called
        return root


def _report_once(key: str, message: str) -> None:
    if key not in reported:
        reported.add(key)
        logger.warning(message)


# -- re-applying islands named in a checkpoint --------------------------------------------


def restore(saved: Any, outputs: Any = None, *, full_names: bool) -> None:
    """Re-apply the islands named in a checkpoint at the next forward pass (a one-shot global pre-hook).

    ``outputs``: the checkpoint's recorded output dtypes by name (absent in checkpoints of earlier versions).
    ``full_names``: the names are qualified from the top-level module (checkpoints
    of this version). Earlier ones are relative to the outermost module called
    then; such a name is looked up as the end of a full name, and re-applied only
    where it names exactly one module.
    """
    wanted = [str(name) for name in saved or () if str(name) and str(name) not in names()]
    if not wanted:
        return
    if _pending["handle"] is not None:  # another scaler's checkpoint (a GAN's): both are looked up
        full_names = full_names and _pending["full_names"]
        wanted = list(dict.fromkeys([*_pending["names"], *wanted]))
    else:
        _pending["outputs"] = {}
    _pending["names"] = wanted
    _pending["outputs"].update(
        (str(name), tuple(str(kind) for kind in kinds))
        for name, kinds in (outputs.items() if isinstance(outputs, dict) else ())
        if isinstance(kinds, (list, tuple))
    )
    _pending["full_names"] = full_names
    if _pending["handle"] is None:
        _pending["handle"] = nn_module.register_module_forward_pre_hook(_restore_into)


def _restore_into(module: torch.nn.Module, args: Any) -> None:
    """At the first module call after loading: each name in the models being trained.

    Looked up first in the top-level module above the module called, when an
    optimizer trains its parameters, then in every other top-level module whose
    parameters an optimizer trains (a GAN's other model; the first call may be
    to a module outside the models: data augmentation, a loss).
    """
    names, outputs, legacy = _pending["names"], _pending["outputs"], not _pending["full_names"]
    _stop_restoring()
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
            make(target, name, outputs.get(saved))
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


def restoring() -> bool:
    return _pending["handle"] is not None


def end_restore_window() -> None:
    """At the end of the first iteration after loading: names never looked up (no module was called) are reported."""
    if _pending["handle"] is None:
        return
    left = _pending["names"]
    _stop_restoring()
    _report_unresolved(left)  # no module was called at all


def _stop_restoring() -> None:
    handle = _pending["handle"]
    _pending["handle"] = None
    _pending["names"] = []
    _pending["outputs"] = {}
    if handle is not None:
        handle.remove()
