"""ampguard: safe fp16 mixed-precision training for PyTorch with one import line.

    import ampguard   # the first line of an existing training script

On import ampguard reads its ``AMPGUARD_*`` environment variables and applies
its patches to torch (``ampguard patches`` lists them). The public API is small:

* :func:`install` / :func:`uninstall` / :func:`status`: the patches;
* :class:`SafeGradScaler`: the GradScaler every ``GradScaler(...)`` becomes;
* :func:`watch`: name a model's parameters in reports of skipped steps;
* :class:`ConfigError`, :class:`ScaleCollapseError`: what ampguard raises.
"""

from __future__ import annotations

import ampguard.errors as errors  # noqa: F401 (bound here too when a failed import left it loaded)
from ampguard._version import __version__ as __version__
from ampguard.errors import ConfigError, ScaleCollapseError
from ampguard.registry import PatchStatus, install, status, uninstall
from ampguard.scaler import SafeGradScaler, ScalerStats
from ampguard.scaler.diagnose import watch

__all__ = [
    "ConfigError",
    "PatchStatus",
    "SafeGradScaler",
    "ScaleCollapseError",
    "ScalerStats",
    "install",
    "status",
    "uninstall",
    "watch",
]


def _invoked_as_the_command() -> bool:
    """``ampguard ...`` or ``python -m ampguard ...``: the command reports a bad variable itself (ampguard.cli)."""
    import os
    import sys

    if sys.argv and os.path.splitext(os.path.basename(sys.argv[0]))[0] == "ampguard":
        return True
    # While ``python -m ampguard`` imports the package, sys.argv[0] is "-m" (runpy); a script's own arguments
    # ("python train.py -m ampguard") are not the command.
    orig_argv = getattr(sys, "orig_argv", [])
    return (
        bool(sys.argv)
        and sys.argv[0] == "-m"
        and "-m" in orig_argv
        and orig_argv[orig_argv.index("-m") + 1 : orig_argv.index("-m") + 2] == ["ampguard"]
    )


def _install_on_import() -> ConfigError | None:
    """Install; a bad variable's ConfigError is returned, for the import to raise (the command reports it)."""
    from ampguard.log import during_import
    from ampguard.registry import hold_banner

    as_the_command = _invoked_as_the_command()
    if as_the_command:
        hold_banner()  # shown by the commands it concerns (ampguard.cli), not before --help or report
    try:
        with during_import():
            install()
    except ConfigError as error:
        if as_the_command:
            return None  # --help, --version, doctor and report still work; the rest stop with one line
        return error
    except Exception as error:  # ampguard must never be the reason a training run dies
        from ampguard.log import logger

        logger.warning("ampguard could not install (%s: %s); torch is left as it was.", type(error).__name__, error)
    return None


_config_error = _install_on_import()
if _config_error is not None:
    # Nothing was patched. The submodules go with the package, so that importing it again once the variable is
    # fixed binds them on the new package object (else `ampguard.scaler` would be an AttributeError).
    import sys as _sys

    for _name in [name for name in _sys.modules if name.startswith("ampguard.") and name != "ampguard.errors"]:
        del _sys.modules[_name]  # (ampguard.errors stays: the ConfigError raised is its class)
    # Raised here, without install's frames: the traceback is the user's import line, this line and the message.
    raise _config_error.with_traceback(None) from None
del _config_error
