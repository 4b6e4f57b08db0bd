"""The ``ampguard`` command (also ``python -m ampguard``).

Each subcommand lives in its own module, which provides
``add_arguments(parser)`` and ``main(args) -> int``; :data:`COMMANDS` lists them.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ampguard.errors import ConfigError

COMMANDS: dict[str, tuple[str, str]] = {
    "patches": ("ampguard.commands.patches", "show each patch: applied, disabled or unavailable, and why"),
    "run": ("ampguard.commands.run", "run a training script (or -m module) with ampguard installed first"),
    "doctor": ("ampguard.commands.doctor", "check this machine and recommend a precision setup"),
    "bench": ("ampguard.commands.bench", "measure ampguard's overhead against plain torch AMP"),
    "report": ("ampguard.commands.report", "summarise and chart a file written with AMPGUARD_STATS_FILE"),
    "selftest": ("ampguard.commands.selftest", "check ampguard on this machine's device against torch's own results"),
}


def build_parser() -> argparse.ArgumentParser:
    from ampguard._version import __version__

    parser = argparse.ArgumentParser(prog="ampguard", description="Safe fp16 mixed-precision training for PyTorch.")
    parser.add_argument("--version", action="version", version=f"ampguard {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a command still being built
            continue
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(sub)
        sub.set_defaults(_module=module)
    return parser


# What works with a bad AMPGUARD_* variable: the doctor reports it as a finding; report needs no configuration.
WORKS_WITHOUT_CONFIG = ("doctor", "report")
# The commands the install banner concerns (``run`` shows it as the script starts: ampguard.commands.run).
SHOW_BANNER = ("patches", "doctor")


def config_error() -> ConfigError | None:
    """The ConfigError the environment's ``AMPGUARD_*`` variables give, if any."""
    import ampguard.config as config
    import ampguard.registry as registry

    try:
        config.load(patch_names=registry.patch_names())
    except ConfigError as error:
        return error
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    # ampguard --help / --version, ampguard COMMAND --help (not a script's own --help after `run script.py`)
    asks_for_help = not argv or any(a in ("-h", "--help", "--version") for a in argv[:2])
    if not asks_for_help and command not in WORKS_WITHOUT_CONFIG:
        error = config_error()
        if error is not None:
            print(f"ampguard: error: {error}", file=sys.stderr)
            return 2
    parser = build_parser()
    if argv and argv[0] == "run":
        # Everything after the script or module belongs to it, not to us.
        import ampguard.commands.run as run

        return run.main_from_argv(argv[1:])
    args = parser.parse_args(argv)
    if not getattr(args, "_module", None):
        parser.print_help()
        return 2
    if args.command in SHOW_BANNER:
        from ampguard.registry import show_banner

        show_banner()
    return int(args._module.main(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
