"""``ampguard run``: run an unmodified training script with ampguard installed first.

    ampguard run train.py --lr 3e-4
    ampguard run -m mypackage.train --lr 3e-4
    python -m ampguard run train.py
    torchrun --nproc-per-node 2 -m ampguard run train.py

The script sees what ``python train.py`` / ``python -m mypackage.train`` would
give it: ``__name__ == "__main__"``, ``sys.argv``, ``sys.path[0]`` (the script's
directory, or the working directory with ``-m``), ``__file__`` as an absolute
path, and the same exit status (``sys.exit`` codes pass through unchanged; an
uncaught exception prints its traceback and exits 1).
"""

from __future__ import annotations

import argparse
import builtins
import functools
import io
import os
import runpy
import sys
import types
from collections.abc import Sequence
from importlib.machinery import SourceFileLoader

USAGE = "ampguard run [-h] (script.py | -m module) [args ...]"
DESCRIPTION = (
    "Run a training script (or -m module) with ampguard installed first, as `python script.py` / "
    "`python -m module` would. Everything after the script or module is passed to it."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Describe the arguments for ``ampguard --help``; parsing itself is :func:`main_from_argv`'s."""
    parser.usage = USAGE
    parser.description = DESCRIPTION
    parser.add_argument("-m", dest="module", metavar="module", help="run a module as `python -m module` does")
    parser.add_argument(
        "script", nargs="?", help="path of the script (a .py file, a directory or a zip with __main__.py)"
    )
    parser.add_argument("args", nargs=argparse.REMAINDER, help="passed to the script as sys.argv[1:]")


def main(args: argparse.Namespace) -> int:
    """Entry point for a namespace parsed by :func:`add_arguments` (the CLI itself uses :func:`main_from_argv`)."""
    if args.module:
        argv = ["-m", args.module, *([args.script] if args.script else []), *args.args]
    else:
        argv = [*([args.script] if args.script else []), *args.args]
    return main_from_argv(argv)


def _help_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ampguard run")
    add_arguments(parser)
    return parser


def main_from_argv(argv: Sequence[str]) -> int:
    """Run ``argv`` (``script.py args...`` or ``-m module args...``) as python would, ampguard installed.

    Returns the exit status when the script returns or raises; a ``SystemExit``
    raised by the script propagates unchanged, as it would under python.
    """
    argv = list(argv)
    if not argv:
        _help_parser().print_usage(sys.stderr)
        print("ampguard run: error: give a script or -m module", file=sys.stderr)
        return 2
    first = argv[0]
    if first in ("-h", "--help"):
        _help_parser().print_help()
        return 0
    module: str | None = None
    rest = argv[1:]
    if first == "-m" or (first.startswith("-m") and len(first) > 2):
        module = first[2:] if len(first) > 2 else (argv[1] if len(argv) > 1 else "")
        rest = argv[1:] if len(first) > 2 else argv[2:]
        if not module:
            print("ampguard run: error: argument -m expects a module name", file=sys.stderr)
            return 2
    elif first.startswith("-") and first != "-":
        _help_parser().print_usage(sys.stderr)
        print(f"ampguard run: error: unknown option {first} (options of the script go after it)", file=sys.stderr)
        return 2

    _install_ampguard()
    try:
        if module is not None:
            _run_module(module, rest)
        else:
            status = _run_path(first, rest)
            if status is not None:
                return status
    except (SystemExit, KeyboardInterrupt):
        raise  # python's own handling: exit codes and messages, SIGINT status
    except BaseException as error:
        _report_uncaught(error)
        return 1
    return 0


def _install_ampguard() -> None:
    """Install ampguard in this process and in the processes the script will spawn."""
    import ampguard  # noqa: F401  (installing is what importing ampguard does)
    from ampguard.registry import show_banner

    show_banner()  # held by `ampguard ...` until now: not before --help or a usage error
    _carry_into_spawned_children()


# -- child processes ----------------------------------------------------------------------


def _carry_into_spawned_children() -> None:
    """Processes the script starts with the spawn or forkserver method get ampguard too.

    A forked child inherits the patched torch. A spawned one (``mp.spawn(...)``,
    ``torch.multiprocessing.spawn``, DataLoader workers with ``spawn``) is a new
    interpreter that re-runs the script's main module as ``__mp_main__``: under
    ``python script.py`` plus ``import ampguard`` in the script, that import
    would run again there; under ``ampguard run`` nothing would. So every
    child's preparation data carries an entry whose unpickling imports ampguard,
    which happens before the child re-runs the main module (``prepare()``
    ignores keys it does not know).
    """
    import multiprocessing.spawn as spawn

    original = spawn.get_preparation_data
    if getattr(original, "_ampguard_carries", False):
        return

    @functools.wraps(original)
    def get_preparation_data(name: str) -> dict[str, object]:
        data = original(name)
        data["ampguard_install"] = _InstallInChild()
        return data

    get_preparation_data._ampguard_carries = True  # type: ignore[attr-defined]
    spawn.get_preparation_data = get_preparation_data


class _InstallInChild:
    """Unpickles, in the child, to the result of importing ampguard (None)."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        # A child whose sys.path cannot reach ampguard still starts, as it would without it.
        return (exec, ("try:\n    import ampguard\nexcept ImportError:\n    pass\n",))


# -- running ------------------------------------------------------------------------------


def _fresh_main(**attributes: object) -> types.ModuleType:
    """A new, empty ``__main__`` module in ``sys.modules``, as python gives a script.

    It stays there after the script returns (as under python), so atexit
    handlers and pickling by ``__main__`` keep working.
    """
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, **attributes)
    sys.modules["__main__"] = main
    return main


def _run_module(module: str, args: list[str]) -> None:
    # python -m: sys.argv[0] is "-m" while the module is located, then its file.
    sys.argv[:] = ["-m", *args]
    _set_path0(os.getcwd())
    _fresh_main()
    _run_as_main(module, alter_argv=True)


def _run_as_main(module: str, *, alter_argv: bool) -> None:
    run_as_main = getattr(runpy, "_run_module_as_main", None)
    if run_as_main is not None:
        # What python itself calls for -m and for directories: runs the module in
        # sys.modules["__main__"] (our fresh module) and reports a missing module
        # as python does ("python: No module named x", exit 1).
        run_as_main(module, alter_argv=alter_argv)
    else:  # pragma: no cover - every CPython 3 has it
        runpy.run_module(module, run_name="__main__", alter_sys=True)


def _run_path(path: str, args: list[str]) -> int | None:
    sys.argv[:] = [path, *args]
    if os.path.isdir(path) or (os.path.isfile(path) and _is_zip(path)):
        # A directory or zip with __main__.py: python puts it first on sys.path
        # and runs the __main__ module found there, in the __main__ namespace.
        _set_path0(_python_abspath(path))
        _fresh_main()
        _run_as_main("__main__", alter_argv=False)
        return None
    absolute = _python_abspath(path)
    try:
        with io.open_code(absolute) as handle:
            source = handle.read()
    except OSError as error:
        print(f"ampguard run: can't open file {absolute!r}: [Errno {error.errno}] {error.strerror}", file=sys.stderr)
        return 2
    _set_path0(os.path.dirname(os.path.realpath(absolute)))
    # runpy.run_path would set sys.argv[0] to the path it is given; python keeps
    # argv[0] as typed but makes __file__ and the code's filename absolute.
    code = compile(source, absolute, "exec", dont_inherit=True)
    main = _fresh_main(
        __file__=absolute,
        __cached__=None,
        __doc__=None,
        __loader__=SourceFileLoader("__main__", absolute),
        __package__=None,
        __spec__=None,
    )
    exec(code, main.__dict__)
    return None


def _python_abspath(path: str) -> str:
    """The absolute path python makes of its script argument: joined to the working directory, not normalised."""
    return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)


def _is_zip(path: str) -> bool:
    import zipfile

    return not path.endswith(".py") and zipfile.is_zipfile(path)


# -- sys.path[0] --------------------------------------------------------------------------


def _set_path0(entry: str) -> None:
    """Make ``entry`` sys.path[0], as python does for the script it runs.

    When this process was started as ``ampguard ...`` / ``python -m ampguard``,
    python put the launcher's own entry there (the console script's directory,
    or the working directory); the script must not see that one, so it is
    replaced. Called from anywhere else, ``entry`` is put in front.
    """
    if getattr(sys.flags, "safe_path", False):
        return  # python -P / PYTHONSAFEPATH: python would add nothing
    launcher = _launcher_path_entry()
    if sys.path and launcher is not None and sys.path[0] == launcher:
        sys.path[0] = entry
    else:
        sys.path.insert(0, entry)


def _launcher_path_entry() -> str | None:
    """The sys.path[0] python chose for the ampguard launcher, when that is what runs this process."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name.partition(".")[0] == "ampguard":
        return os.getcwd()  # python -m ampguard
    file = getattr(main, "__file__", None)
    if (
        spec is None
        and isinstance(file, str)
        and os.path.basename(file).lower() in ("ampguard", "ampguard-script.py", "ampguard.exe")
    ):
        return os.path.dirname(os.path.realpath(file))  # the console script
    return None


# -- errors -------------------------------------------------------------------------------


def _report_uncaught(error: BaseException) -> None:
    """What python does with an uncaught exception: ``sys.excepthook``, without ampguard's own frames."""
    traceback = error.__traceback__
    own = {__file__, runpy.__file__, "<frozen runpy>"}
    while traceback is not None and traceback.tb_frame.f_code.co_filename in own:
        traceback = traceback.tb_next
    # python's default hook prints the exception's own __traceback__, not its
    # argument; None (a SyntaxError in the script itself) prints just the error.
    error.__traceback__ = traceback
    sys.excepthook(type(error), error, traceback)
