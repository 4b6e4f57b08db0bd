"""``ampguard run``: an unmodified script runs as under python, with ampguard installed first.

Every test compares real processes: ``python script.py`` as the reference, and
``python -m ampguard run`` / the ``ampguard`` console script under test. What depends
on how the process started (``sys.path[0]``, the launcher's own entry, ``AMPGUARD=0``
at import, spawned children) starts a fresh launcher each time; the exit statuses and
outputs of the other cases come from processes forked by one driver that imported
torch and ampguard once (:data:`DRIVER`): each case still ends as a process of its own,
its exit status and output made by python as ``python -m ampguard`` makes them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

PROBE = '''
"""Reports how it was run; imports neither ampguard nor anything but the stdlib and torch."""
import json
import os
import pickle
import sys


class Point:
    def __init__(self, x):
        self.x = x


def report():
    import torch

    return {
        "argv": sys.argv,
        "name": __name__,
        "file": __file__,
        "spec": getattr(__spec__, "name", None),
        "package": __package__,
        "path": sys.path,
        "main_is_this_module": sys.modules["__main__"].__dict__ is globals(),
        "pickled_by_main": pickle.loads(pickle.dumps(Point(3))).x,
        "ampguard_imported": "ampguard" in sys.modules,
        "scaler": type(torch.amp.GradScaler("cpu")).__name__,
    }


if __name__ == "__main__":
    print("PROBE " + json.dumps(report()), flush=True)
    sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
'''


def _console_script() -> str | None:
    candidate = Path(sys.executable).with_name("ampguard")
    return str(candidate) if candidate.exists() else shutil.which("ampguard")


LAUNCHERS = {
    "python -m ampguard": [sys.executable, "-m", "ampguard"],
    "console script": [_console_script()],
}


def _launcher(name: str) -> list[str]:
    command = LAUNCHERS[name]
    if command[0] is None:
        pytest.skip("the ampguard console script is not installed next to this python")
    return list(command)


def _run(command: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, **env}
    return subprocess.run(command, cwd=cwd, env=environment, capture_output=True, text=True, timeout=120)


def _probe(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    lines = [line for line in result.stdout.splitlines() if line.startswith("PROBE ")]
    assert lines, f"no report (exit {result.returncode}):\n{result.stdout}\n{result.stderr}"
    return json.loads(lines[-1][len("PROBE ") :])


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("probe")
    scripts = root / "scripts"
    scripts.mkdir()
    path = scripts / "probe.py"
    path.write_text(PROBE)
    (root / "elsewhere").mkdir()
    return path


PROBE_ARGS = ["--lr", "3e-4", "-m", "not-ours", "--", "x y"]


@pytest.fixture(scope="module")
def probe_reference(probe: Path) -> dict[str, Any]:
    """``python scripts/probe.py ARGS`` from another directory: the reference both launchers are held to."""
    cwd = probe.parent.parent / "elsewhere"
    return _probe(_run([sys.executable, os.path.relpath(probe, cwd), *PROBE_ARGS], cwd))


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_script_sees_what_python_gives_it(launcher: str, probe: Path, probe_reference: dict[str, Any]) -> None:
    cwd = probe.parent.parent / "elsewhere"
    relative = os.path.relpath(probe, cwd)
    args = PROBE_ARGS

    reference = probe_reference
    result = _run([*_launcher(launcher), "run", relative, *args], cwd)
    observed = _probe(result)

    assert result.returncode == 0, result.stderr
    assert reference["scaler"] == "GradScaler" and not reference["ampguard_imported"]
    assert observed["scaler"] == "SafeGradScaler"
    assert observed["ampguard_imported"]
    for key in ("argv", "name", "file", "spec", "package", "main_is_this_module", "pickled_by_main"):
        assert observed[key] == reference[key], key
    assert observed["argv"] == [relative, *args]
    assert observed["file"] == os.path.join(cwd, relative)  # absolute, not normalised: python's way
    # sys.path[0] is the script's directory, and the launcher's own entry (the
    # working directory, or the console script's directory) is gone.
    assert observed["path"] == reference["path"]
    assert observed["path"][0] == str(probe.parent)


def test_module_sees_what_python_m_gives_it(tmp_path: Path) -> None:
    package = tmp_path / "trainpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "helpers.py").write_text("VALUE = 42\n")
    (package / "train.py").write_text(PROBE.replace("import json\n", "import json\nfrom .helpers import VALUE\n", 1))

    args = ["--epochs", "2"]
    reference = _probe(_run([sys.executable, "-m", "trainpkg.train", *args], tmp_path))
    result = _run([sys.executable, "-m", "ampguard", "run", "-m", "trainpkg.train", *args], tmp_path)
    observed = _probe(result)

    assert result.returncode == 0, result.stderr
    assert observed["scaler"] == "SafeGradScaler" and reference["scaler"] == "GradScaler"
    for key in ("argv", "name", "file", "spec", "package", "main_is_this_module", "pickled_by_main", "path"):
        assert observed[key] == reference[key], key
    assert observed["argv"] == [str(package / "train.py"), *args]
    assert observed["spec"] == "trainpkg.train"
    assert observed["path"][0] == str(tmp_path)


EXIT_CASES = [
    ("exit-3", "import sys\nsys.exit(3)\n", 3, None),
    ("exit-message", "import sys\nsys.exit('fatal: no data')\n", 1, "fatal: no data"),
    ("exit-none", "import sys\nsys.exit()\n", 0, None),
    ("uncaught", "def train():\n    raise ValueError('boom')\n\ntrain()\n", 1, "ValueError: boom"),
    ("syntax-error", "x = (\n", 1, "SyntaxError"),
    ("clean", "print('done')\n", 0, None),
    # what an atexit handler finds as the process ends: the script's argv and __main__, as under python
    (
        "atexit",
        "import atexit, sys\n"
        "atexit.register(lambda: print(sys.argv, sys.modules['__main__'].__dict__ is globals()))\n"
        "sys.exit(4)\n",
        4,
        None,
    ),
]

TRAIN = textwrap.dedent("""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    assert type(scaler).__name__ == "SafeGradScaler", type(scaler)
    for step in range(4):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(8, 4)).float().pow(2).mean()
        if step == 1:
            loss = loss * float("inf")
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    assert scaler.stats.skipped == 1, scaler.stats
    print("skipped", scaler.stats.skipped)
""")

DRIVER = """
import gc, json, os, runpy, sys

import ampguard  # what `python -m ampguard` imports before it runs ampguard.__main__: torch, and the install

gc.freeze()  # else each child's exit collects torch's objects, copying every page it shares with this process

results = {}
for name, (cwd, args) in json.loads(sys.argv[1]).items():
    out, err = os.path.join(cwd, name + ".out"), os.path.join(cwd, name + ".err")
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.chdir(cwd)
        for fd, path in ((1, out), (2, err)):
            handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(handle, fd)
            os.close(handle)
        sys.argv = ["-m", *args]
        # ampguard.__main__ as python -m runs it (what python calls for -m: in sys.modules["__main__"], which it does
        # not put back, nor sys.argv, so that atexit sees what python's would); its SystemExit (or the script's)
        # ends this child as it ends python.
        runpy._run_module_as_main("ampguard")
        raise SystemExit("ampguard.__main__ returned")
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    with open(out) as stdout, open(err) as stderr:
        results[name] = [status, stdout.read(), stderr.read()]
print("RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[str]]:
    """``python -m ampguard ARGS`` for every case below: exit status, stdout and stderr, each from its own process."""
    root = tmp_path_factory.mktemp("cases")
    cases: dict[str, tuple[str, list[str]]] = {}
    for name, body, _, _ in EXIT_CASES:
        (root / name).mkdir()
        (root / name / "job.py").write_text(body)
        cases[name] = (str(root / name), ["run", str(root / name / "job.py")])
    (root / "train.py").write_text(TRAIN)
    cases |= {
        "missing-script": (str(root), ["run", "nope.py"]),
        "missing-module": (str(root), ["run", "-m", "no_such_module_here"]),
        "usage": (str(root), ["run"]),
        "help": (str(root), ["run", "-h"]),
        "train": (str(root), ["run", str(root / "train.py")]),
    }
    driver = _run([sys.executable, "-c", DRIVER, json.dumps(cases)], root)
    lines = [line for line in driver.stdout.splitlines() if line.startswith("RESULTS ")]
    assert driver.returncode == 0 and lines, f"driver failed (exit {driver.returncode}):\n{driver.stderr}"
    return {
        name: subprocess.CompletedProcess(cases[name][1], status, stdout, stderr)
        for name, (status, stdout, stderr) in json.loads(lines[0][len("RESULTS ") :]).items()
    }


@pytest.mark.parametrize(
    ("case", "expected_code", "stderr_has"),
    [(name, code, stderr_has) for name, _, code, stderr_has in EXIT_CASES],
    ids=[name for name, *_ in EXIT_CASES],
)
def test_exit_status_is_pythons(
    ran: dict[str, subprocess.CompletedProcess[str]], case: str, expected_code: int, stderr_has: str | None
) -> None:
    result = ran[case]
    script = Path(result.args[-1])
    reference = _run([sys.executable, str(script)], script.parent)

    assert reference.returncode == expected_code
    assert result.returncode == expected_code, result.stderr
    assert result.stdout == reference.stdout
    if stderr_has:
        assert stderr_has in result.stderr


def test_uncaught_traceback_starts_in_the_script(ran: dict[str, subprocess.CompletedProcess[str]]) -> None:
    result = ran["uncaught"]
    script = Path(result.args[-1])
    reference = _run([sys.executable, str(script)], script.parent)

    assert result.returncode == 1
    assert "ampguard" not in result.stderr.replace(str(script), "")  # no frame of ours
    assert result.stderr == reference.stderr


def test_missing_script_and_module(ran: dict[str, subprocess.CompletedProcess[str]]) -> None:
    missing = ran["missing-script"]
    assert missing.returncode == 2
    assert "can't open file" in missing.stderr and "nope.py" in missing.stderr

    no_module = ran["missing-module"]
    assert no_module.returncode == 1
    assert "No module named no_such_module_here" in no_module.stderr


def test_usage(ran: dict[str, subprocess.CompletedProcess[str]]) -> None:
    empty = ran["usage"]
    assert empty.returncode == 2 and "usage: ampguard run" in empty.stderr

    # (every `ampguard run` also builds the full CLI parser, so add_arguments runs in each test here)
    helped = ran["help"]
    assert helped.returncode == 0 and "-m module" in helped.stdout


def test_script_trains_with_safe_scaler_without_importing_ampguard(
    ran: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    """An unmodified AMP loop: under ``ampguard run`` its scaler is ampguard's and counts the injected skip."""
    result = ran["train"]
    script = Path(result.args[-1])
    plain = _run([sys.executable, str(script)], script.parent)
    assert plain.returncode == 1 and "SafeGradScaler" in plain.stderr  # the check bites without ampguard

    assert result.returncode == 0, result.stderr
    assert "skipped 1" in result.stdout


def test_ampguard_off_still_runs_the_script(tmp_path: Path, probe: Path) -> None:
    result = _run([sys.executable, "-m", "ampguard", "run", str(probe)], tmp_path, AMPGUARD="0")
    assert result.returncode == 0, result.stderr
    assert _probe(result)["scaler"] == "GradScaler"


def test_spawned_child_processes_get_ampguard_too(tmp_path: Path) -> None:
    """``mp.spawn``-style workers re-run the script as ``__mp_main__`` in a new interpreter: ampguard is there first."""
    script = tmp_path / "launch.py"
    script.write_text(
        textwrap.dedent("""
        import multiprocessing as mp
        import sys

        import torch


        def worker(queue):
            queue.put(("ampguard" in sys.modules, type(torch.amp.GradScaler("cpu")).__name__))


        if __name__ == "__main__":
            for method in ("spawn", "fork"):
                context = mp.get_context(method)
                queue = context.Queue()
                child = context.Process(target=worker, args=(queue,))
                child.start()
                print(method, *queue.get(timeout=120), flush=True)
                child.join()
                assert child.exitcode == 0
    """)
    )

    result = _run([sys.executable, "-m", "ampguard", "run", str(script)], tmp_path, AMPGUARD_QUIET="1")

    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["spawn True SafeGradScaler", "fork True SafeGradScaler"]


def test_directory_with_main_runs_as_under_python(tmp_path: Path) -> None:
    app = tmp_path / "app"
    app.mkdir()
    (app / "__main__.py").write_text(PROBE)

    reference = _probe(_run([sys.executable, "app", "x"], tmp_path))
    observed = _probe(_run([sys.executable, "-m", "ampguard", "run", "app", "x"], tmp_path))

    for key in ("argv", "name", "file", "spec", "package", "main_is_this_module", "pickled_by_main", "path"):
        assert observed[key] == reference[key], key
    assert observed["scaler"] == "SafeGradScaler"
