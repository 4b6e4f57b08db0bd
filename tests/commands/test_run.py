"""``ampguard run``: an unmodified script runs as under python, with ampguard installed first.

Every test starts real processes: ``python script.py`` as the reference, and
``python -m ampguard run`` / the ``ampguard`` console script under test.
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


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    path = scripts / "probe.py"
    path.write_text(PROBE)
    (tmp_path / "elsewhere").mkdir()
    return path


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_script_sees_what_python_gives_it(launcher: str, probe: Path) -> None:
    cwd = probe.parent.parent / "elsewhere"
    relative = os.path.relpath(probe, cwd)
    args = ["--lr", "3e-4", "-m", "not-ours", "--", "x y"]

    reference = _probe(_run([sys.executable, relative, *args], cwd))
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


@pytest.mark.parametrize(
    ("body", "expected_code", "stderr_has"),
    [
        ("import sys\nsys.exit(3)\n", 3, None),
        ("import sys\nsys.exit('fatal: no data')\n", 1, "fatal: no data"),
        ("import sys\nsys.exit()\n", 0, None),
        ("def train():\n    raise ValueError('boom')\n\ntrain()\n", 1, "ValueError: boom"),
        ("x = (\n", 1, "SyntaxError"),
        ("print('done')\n", 0, None),
    ],
    ids=["exit-3", "exit-message", "exit-none", "uncaught", "syntax-error", "clean"],
)
def test_exit_status_is_pythons(tmp_path: Path, body: str, expected_code: int, stderr_has: str | None) -> None:
    script = tmp_path / "job.py"
    script.write_text(body)

    reference = _run([sys.executable, str(script)], tmp_path)
    result = _run([sys.executable, "-m", "ampguard", "run", str(script)], tmp_path)

    assert reference.returncode == expected_code
    assert result.returncode == expected_code, result.stderr
    assert result.stdout == reference.stdout
    if stderr_has:
        assert stderr_has in result.stderr


def test_uncaught_traceback_starts_in_the_script(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text("def train():\n    raise ValueError('boom')\n\ntrain()\n")

    reference = _run([sys.executable, str(script)], tmp_path)
    result = _run([sys.executable, "-m", "ampguard", "run", str(script)], tmp_path, AMPGUARD_QUIET="1")

    assert result.returncode == 1
    assert "ampguard" not in result.stderr.replace(str(script), "")  # no frame of ours
    assert result.stderr == reference.stderr


def test_missing_script_and_module(tmp_path: Path) -> None:
    missing = _run([sys.executable, "-m", "ampguard", "run", "nope.py"], tmp_path)
    assert missing.returncode == 2
    assert "can't open file" in missing.stderr and "nope.py" in missing.stderr

    no_module = _run([sys.executable, "-m", "ampguard", "run", "-m", "no_such_module_here"], tmp_path)
    assert no_module.returncode == 1
    assert "No module named no_such_module_here" in no_module.stderr


def test_usage(tmp_path: Path) -> None:
    empty = _run([sys.executable, "-m", "ampguard", "run"], tmp_path)
    assert empty.returncode == 2 and "usage: ampguard run" in empty.stderr

    # (every `ampguard run` also builds the full CLI parser, so add_arguments runs in each test here)
    helped = _run([sys.executable, "-m", "ampguard", "run", "-h"], tmp_path)
    assert helped.returncode == 0 and "-m module" in helped.stdout


def test_script_trains_with_safe_scaler_without_importing_ampguard(tmp_path: Path) -> None:
    """An unmodified AMP loop: under ``ampguard run`` its scaler is ampguard's and counts the injected skip."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent("""
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
    )

    plain = _run([sys.executable, str(script)], tmp_path)
    assert plain.returncode == 1 and "SafeGradScaler" in plain.stderr  # the check bites without ampguard

    result = _run([sys.executable, "-m", "ampguard", "run", str(script)], tmp_path)
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
