"""Which patches exist, and installing / uninstalling them.

The registry is data: :data:`PATCHES` lists each patch class by import path, in
the order they are applied. Everything else here is the machinery the public
API (``install``, ``uninstall``, ``status``) runs on: a lock, the config read at
install, and a status entry per patch.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any, Literal

import ampguard.config as config_module
import ampguard.stats.file as stats_file
import ampguard.torch_privates as torch_privates
from ampguard.bindings import rebind_queued, restore_imported_since
from ampguard.errors import ConfigError, PatchUnavailable
from ampguard.log import ensure_default_handler, event, is_rank_zero, logger
from ampguard.patch import Patch, torch_release

PATCHES: tuple[str, ...] = (
    "ampguard.patches.autocast:AutocastPatch",
    "ampguard.patches.grad_scaler:GradScalerPatch",
    "ampguard.clip_grad.patch:ClipGradPatch",
    "ampguard.patches.bf16_check:Bf16CheckPatch",
    "ampguard.fp32_islands.patch:Fp32IslandsPatch",
    "ampguard.patches.anomaly:AnomalyPatch",
    "ampguard.master_weights.patch:MasterWeightsPatch",
    "ampguard.scheduler_hold.patch:SchedulerHoldPatch",
    "ampguard.underflow.patch:UnderflowPatch",
    "ampguard.trainer_logs.patch:TrainerLogsPatch",
    "ampguard.deepspeed_fp16.patch:DeepSpeedFp16Patch",
)

State = Literal["applied", "disabled", "unavailable"]


@dataclass(frozen=True)
class PatchStatus:
    """One patch's state after install: ``applied``, ``disabled`` or ``unavailable``, and why."""

    name: str
    state: State
    reason: str
    summary: str

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


class _Registry:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.patches: list[Patch] = [_load(path) for path in PATCHES]
        self.installed = False
        self.config: config_module.Config | None = None
        self.statuses: dict[str, PatchStatus] = {}
        self.banner_shown = False
        self.banner_held = False

    def names(self) -> list[str]:
        return [p.name for p in self.patches]


def _load(path: str) -> Patch:
    module_name, _, class_name = path.partition(":")
    patch: Patch = getattr(importlib.import_module(module_name), class_name)()
    return patch


_registry = _Registry()


def patch_names() -> list[str]:
    return _registry.names()


def active_config() -> config_module.Config:
    """The configuration read at install, or the environment's now when ampguard is not installed."""
    with _registry.lock:
        if _registry.config is not None:
            return _registry.config
    return config_module.load(patch_names=patch_names())


def _decide(patch: Patch, config: config_module.Config) -> tuple[State, str] | None:
    """Why ``patch`` is not to be applied, or None when it is."""
    if not config.enabled:
        return "disabled", "AMPGUARD=0"
    if patch.name in config.disable:
        return "disabled", "AMPGUARD_DISABLE"
    if patch.opt_in and patch.name not in config.enable:
        return "disabled", f"opt-in: set AMPGUARD_ENABLE={patch.name}"
    if not patch.supports():
        return "unavailable", f"needs torch {patch.requires_torch}, this is {torch_release()}"
    changed = torch_privates.problem(patch.requires_privates)
    if changed is not None:
        return "unavailable", f"a torch internal it relies on changed: {changed}"
    return None


def install(environ: Mapping[str, str] | None = None) -> list[PatchStatus]:
    """Apply every enabled patch. Idempotent and thread-safe.

    Reads the ``AMPGUARD_*`` variables from ``environ`` (default:
    ``os.environ``); a bad value raises :class:`~ampguard.ConfigError` before
    anything is patched. A patch that fails to apply is reported unavailable
    and the rest go on.
    """
    with _registry.lock:
        if _registry.installed:
            return status()
        ensure_default_handler()  # first: reading the environment may warn (an unknown AMPGUARD_* name)
        config = config_module.load(environ, patch_names=_registry.names())
        stats_file.attach(config.stats_file)  # after the default handler, which ampguard adds only to a bare logger
        # Filled as the patches apply, so that a patch finds those applied before it (applied_patch()).
        statuses: dict[str, PatchStatus] = {}
        _registry.statuses = statuses
        for patch in _registry.patches:
            verdict = _decide(patch, config)
            if verdict is None:
                verdict = _apply(patch, config)
            statuses[patch.name] = PatchStatus(patch.name, verdict[0], verdict[1], patch.summary)
        applied = [p for p in _registry.patches if statuses[p.name].state == "applied"]
        refused = [statuses[name] for name in sorted(config.enable) if statuses[name].state == "unavailable"]
        if refused:  # asked for by name: an error with the reason, not a quiet skip (sentry-sdk's DidNotEnable)
            for patch in reversed(applied):
                _revert_quietly(patch)
            stats_file.attach(None)
            _registry.statuses = {}
            raise ConfigError(
                "AMPGUARD_ENABLE",
                ",".join(sorted(config.enable)),
                "patches that can apply here",
                message="; ".join(
                    f"AMPGUARD_ENABLE names {s.name}, which cannot apply here: {s.reason}" for s in refused
                )
                + ". Remove it from AMPGUARD_ENABLE (`ampguard patches` lists what applies on this machine).",
            )
        try:
            rebind_queued([p.bindings for p in applied])
        except Exception as error:  # never the cause of a crash: report and go on
            logger.warning("ampguard could not rebind names bound before it was imported: %r", error)
        _registry.config = config
        _registry.installed = True
        _show_banner(config, statuses)
        return status()


def _apply(patch: Patch, config: config_module.Config) -> tuple[State, str]:
    try:
        patch.apply(config)
    except PatchUnavailable as reason:
        _revert_quietly(patch)
        return "unavailable", str(reason)
    except Exception as error:
        _revert_quietly(patch)
        logger.warning(
            "ampguard patch %r could not be applied and is off (%s: %s); training runs on without it.",
            patch.name,
            type(error).__name__,
            error,
        )
        return "unavailable", f"failed to apply: {type(error).__name__}: {error}"
    return "applied", ""


def _revert_quietly(patch: Patch) -> None:
    try:
        patch.revert()
    except Exception as error:
        logger.warning("ampguard patch %r could not be reverted cleanly: %r", patch.name, error)


def uninstall() -> None:
    """Revert every applied patch, newest first, restoring the original objects."""
    with _registry.lock:
        if not _registry.installed:
            return
        applied = [p for p in _registry.patches if _registry.statuses[p.name].state == "applied"]
        try:
            restore_imported_since([p.bindings for p in applied])
        except Exception as error:  # never the cause of a crash
            logger.warning("ampguard could not restore names bound while it was installed: %r", error)
        for patch in reversed(applied):
            _revert_quietly(patch)
        _registry.installed = False
        stats_file.attach(None)
        _registry.config = None
        _registry.statuses = {}


_import_hooks: set[tuple[str, Any]] = set()  # (module name, act): wrapt keeps a post-import hook for the process


def when_imported(patch: Patch, module_name: str, act: Callable[[Any, ModuleType], None]) -> None:
    """From ``patch.apply()``: ``act(patch, module)`` now when ``module_name`` is imported already, and at its
    import later while a patch of that name is applied (found then with :func:`applied_patch`).

    wrapt keeps a post-import hook for good, so each (module, act) is hooked once per process; ``act`` must do
    nothing the second time for one module (an import racing with the install calls it twice).
    """
    key = (module_name, act)
    if key not in _import_hooks:
        import wrapt

        _import_hooks.add(key)
        # (called at once when the module is imported already: the patch is not applied yet, so it does nothing)
        wrapt.register_post_import_hook(functools.partial(_imported, patch.name, act), module_name)
    module = sys.modules.get(module_name)
    if module is not None:
        act(patch, module)


def _imported(name: str, act: Callable[[Any, ModuleType], None], module: ModuleType) -> None:
    patch = applied_patch(name)
    if patch is not None:
        act(patch, module)


def is_installed() -> bool:
    return _registry.installed


def applied_patch(name: str) -> Patch | None:
    """The patch object named ``name`` while it is applied (installed, not off), else None; during an install, once
    it has applied (a patch's ``apply()`` finds those before it in the registry's order)."""
    with _registry.lock:
        entry = _registry.statuses.get(name)
        if entry is None or entry.state != "applied":
            return None
        return next((patch for patch in _registry.patches if patch.name == name), None)


def status() -> list[PatchStatus]:
    """One entry per patch, in registry order. Before install every patch reads ``disabled``."""
    with _registry.lock:
        return [
            _registry.statuses.get(p.name) or PatchStatus(p.name, "disabled", "not installed", p.summary)
            for p in _registry.patches
        ]


def hold_banner() -> None:
    """Installs show no banner until :func:`show_banner`: the ``ampguard`` command shows it only where it helps."""
    _registry.banner_held = True


def show_banner() -> None:
    """Show the banner of the install made while it was held (once per process; nothing when not installed)."""
    from ampguard.log import during_import

    with _registry.lock:
        _registry.banner_held = False
        if _registry.installed and _registry.config is not None:
            with during_import():  # laid out as at import: no rich imported for one line
                _show_banner(_registry.config, _registry.statuses)


def started_by_multiprocessing() -> bool:
    """Whether this process is a multiprocessing child: a DataLoader worker, an ``mp.spawn`` process.

    A spawned (or forkserver) child imports the main module again, and so
    ampguard, while it unpickles its preparation data (``_inheriting`` is set
    then, as multiprocessing's own ``_check_not_importing_main`` reads it);
    once started, its ``parent_process()`` is set. A forked child inherits the
    parent's ampguard, banner shown. In any other process ``parent_process()``
    is None, or multiprocessing is not even imported.
    """
    process = sys.modules.get("multiprocessing.process")
    if process is None:
        return False
    try:
        return process.parent_process() is not None or bool(getattr(process.current_process(), "_inheriting", False))
    except Exception:  # a multiprocessing without these: treated as the main process
        return False


def _show_banner(config: config_module.Config, statuses: dict[str, PatchStatus]) -> None:
    """The banner, once per run: not in multiprocessing children (their parent showed it), only on rank 0."""
    if config.quiet or _registry.banner_shown or _registry.banner_held or not is_rank_zero():
        return
    if started_by_multiprocessing():
        return
    _registry.banner_shown = True
    from ampguard._version import __version__

    applied = [name for name, s in statuses.items() if s.state == "applied"]
    off = [f"{name} ({s.state})" for name, s in statuses.items() if s.state != "applied"]
    message = f"{__version__} on torch {torch_release()}: " + (
        "patched " + ", ".join(applied) if applied else "nothing patched"
    )
    if off:
        message += "; off: " + ", ".join(off)
    logger.log(logging.INFO, message, extra=event("start"))
