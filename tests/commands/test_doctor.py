"""``ampguard doctor``: the report, its JSON validated against docs/doctor.md, recommendations on mocked GPUs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_support import ampguard_cli  # noqa: F401  (a fixture)

from ampguard import machine
from ampguard.commands import doctor
from ampguard.config import Config

DOCS = Path(__file__).resolve().parents[2] / "docs" / "doctor.md"
ROW = re.compile(r"^\| `([^`]+)` \| ([^|]+?) \|")


def documented_fields() -> dict[str, str]:
    fields = {}
    for line in DOCS.read_text().splitlines():
        match = ROW.match(line)
        if match:
            fields[match.group(1)] = match.group(2).strip()
    assert fields, "no field table in docs/doctor.md"
    return fields


def _scalar_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    raise AssertionError(f"unexpected JSON value {value!r}")


def emitted_fields(data: Any, documented: dict[str, str], path: str = "") -> dict[str, str]:
    """``{path: type}`` for everything in ``data``, read the way the table describes it."""
    found: dict[str, str] = {}
    for key, value in data.items():
        here = f"{path}{key}"
        if documented.get(here) == "map":
            assert isinstance(value, dict), here
            found[here] = "map"
        elif isinstance(value, dict):
            found[here] = "object"
            found.update(emitted_fields(value, documented, here + "."))
        elif isinstance(value, list):
            if documented.get(here) == "array of string" and all(isinstance(item, str) for item in value):
                found[here] = "array of string"
            else:
                found[here] = "array"
                for item in value:
                    assert isinstance(item, dict), f"{here} holds {item!r}"
                    found.update(emitted_fields(item, documented, here + "[]."))
        else:
            found[here] = _scalar_type(value)
    return found


def assert_matches_docs(data: dict[str, Any], *, complete: bool) -> None:
    documented = documented_fields()
    emitted = emitted_fields(data, documented)
    undocumented = sorted(set(emitted) - set(documented))
    assert not undocumented, f"fields missing from docs/doctor.md: {undocumented}"
    for name, kind in emitted.items():
        allowed = {part.strip() for part in documented[name].split(" or ")}
        assert kind in allowed, f"{name}: emitted {kind}, documented {documented[name]}"
    if complete:
        missing = sorted(set(documented) - set(emitted))
        assert not missing, f"documented but not emitted: {missing}"


def _properties(name: str, major: int, minor: int, gib: float) -> types.SimpleNamespace:
    return types.SimpleNamespace(name=name, major=major, minor=minor, total_memory=int(gib * 2**30))


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch):
    """``gpus(props, ...)``: torch.cuda answers as if these devices were present (mocked)."""

    def _set(*devices: types.SimpleNamespace, bf16_says: bool = True) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(devices))
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(devices))
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: devices[index])
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_says)
        monkeypatch.setattr(torch.version, "cuda", "12.1")

    machine.gpu_info.cache_clear()
    yield _set
    machine.gpu_info.cache_clear()


T4 = _properties("Tesla T4", 7, 5, 14.75)
A100 = _properties("NVIDIA A100-SXM4-40GB", 8, 0, 39.5)


def test_json_of_a_mocked_t4_machine_matches_every_documented_field(gpus, monkeypatch):
    gpus(T4)
    monkeypatch.setenv("AMPGUARD_STATS_EVERY", "100")
    monkeypatch.setattr(machine, "installed_libraries", lambda: {"accelerate": "1.1.1", "transformers": "4.46.3"})
    data = json.loads(json.dumps(doctor.collect()))
    assert_matches_docs(data, complete=True)
    assert data["gpus"] == [
        {"index": 0, "name": "Tesla T4", "capability": "7.5", "total_memory_gib": 14.75, "bf16_native": False}
    ]
    assert data["torch"]["is_bf16_supported"] is True  # what torch claims, next to the truth
    assert data["environment"]["AMPGUARD_STATS_EVERY"] == "100"
    assert data["libraries"] == [
        {"name": "accelerate", "version": "1.1.1"},
        {"name": "transformers", "version": "4.46.3"},
    ]
    assert set(data["config"]) == {f.name for f in dataclasses.fields(Config)}


def test_docs_type_check_can_fail():
    with pytest.raises(AssertionError, match="missing from docs"):
        assert_matches_docs({"schema_version": 1, "surprise": 1}, complete=False)
    with pytest.raises(AssertionError, match="documented integer"):
        assert_matches_docs({"schema_version": "1"}, complete=False)
    with pytest.raises(AssertionError, match="documented but not emitted"):
        assert_matches_docs({"schema_version": 1}, complete=True)


@pytest.mark.parametrize(
    ("devices", "precision", "dtype", "scaler"),
    [
        ((A100,), "bf16", "bfloat16", False),
        ((T4,), "fp16", "float16", True),
        ((A100, T4), "fp16", "float16", True),
        ((), "fp32", None, False),
    ],
    ids=["mocked-a100", "mocked-t4", "mocked-mixed", "no-gpu"],
)
def test_recommendation_per_machine(gpus, devices, precision, dtype, scaler):
    gpus(*devices)
    advice = doctor.collect()["recommendation"]
    assert (advice["precision"], advice["autocast_dtype"], advice["grad_scaler"]) == (precision, dtype, scaler)
    assert advice["weights_dtype"] == "float32"
    assert any("Never train with float16 weights" in reason for reason in advice["reasons"])
    if devices == (T4,):
        assert "SafeGradScaler" in advice["summary"]
        assert any("cuda:0 (Tesla T4, compute capability 7.5)" in reason for reason in advice["reasons"])


def test_a_broken_driver_does_not_break_the_doctor(monkeypatch):
    def broken() -> bool:
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(torch.cuda, "is_available", broken)
    data = doctor.collect()
    assert data["torch"]["cuda_error"] == "RuntimeError: CUDA driver initialization failed"
    assert data["gpus"] == [] and data["recommendation"]["precision"] == "fp32"


def test_patch_states_and_environment_are_reported(reinstall):
    reinstall(AMPGUARD_DISABLE="bf16_check")
    data = doctor.collect()
    states = {p["name"]: (p["state"], p["reason"]) for p in data["patches"]}
    assert states["bf16_check"] == ("disabled", "AMPGUARD_DISABLE")
    assert states["anomaly"][0] == "disabled" and "opt-in" in states["anomaly"][1]
    assert data["config"]["disable"] == ["bf16_check"]
    assert data["environment"]["AMPGUARD_DISABLE"] == "bf16_check"


def test_tables_on_a_mocked_t4(gpus, capsys):
    gpus(T4)
    assert doctor.main(argparse.Namespace(json=False)) == 0
    out = capsys.readouterr().out
    assert re.search(r"0\s+Tesla T4\s+7\.5\s+14\.75\s+no", out)
    assert "torch.cuda.is_bf16_supported()  True" in out
    assert "recommendation: fp16 autocast with a GradScaler" in out


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m ampguard doctor ARGS``, started fresh, with these AMPGUARD_* variables only."""
    environment = {k: v for k, v in os.environ.items() if not k.upper().startswith("AMPGUARD")}
    environment.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "ampguard", "doctor", *args],
        capture_output=True,
        text=True,
        env=environment,
        timeout=120,
    )


def test_cli_json_on_this_machine_matches_the_docs():
    """A fresh process: the variables are read by the install at import, and the banner stays off stdout."""
    result = _run("--json", env={"AMPGUARD_ENABLE": "anomaly"})
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)  # nothing but the JSON on stdout
    assert_matches_docs(data, complete=False)
    assert data["torch"]["version"] == torch.__version__
    assert data["python"]["executable"] == sys.executable
    assert {p["name"]: p["state"] for p in data["patches"]}["anomaly"] == "applied"
    if not torch.cuda.is_available():
        assert data["gpus"] == [] and data["recommendation"]["precision"] == "fp32"


def test_cli_tables_as_plain_text(ampguard_cli):
    result = ampguard_cli("doctor", env={})
    assert result.returncode == 0, result.stderr
    for heading in ("ampguard doctor", "patches", "configuration", "recommendation:"):
        assert heading in result.stdout
    assert "\x1b[" not in result.stdout  # no terminal codes when piped
    assert "AMPGUARD_BF16_FALLBACK" in result.stdout


def test_libraries_come_from_metadata_without_importing_them(tmp_path, monkeypatch):
    """A fake 'transformers' whose import would fail: the doctor lists its version and never imports it."""
    package = tmp_path / "transformers"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('the doctor imported transformers')\n")
    info = tmp_path / "transformers-99.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 99.1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # found first, as PYTHONPATH would put it
    for name in [name for name in sys.modules if name.partition(".")[0] == "transformers"]:
        monkeypatch.delitem(sys.modules, name)  # another test may have imported the real one
    libraries = doctor.collect()["libraries"]
    assert {"name": "transformers", "version": "99.1.0"} in libraries
    assert "transformers" not in sys.modules


@pytest.mark.parametrize("json_flag", [(), ("--json",)])
def test_exit_status_0_with_a_good_configuration_or_only_an_unknown_name(json_flag, ampguard_cli):
    """Exit 0: a name ampguard does not know is a warning; the JSON keeps its shape."""
    result = ampguard_cli("doctor", *json_flag, env={"AMPGUARD_QUIET": "1", "AMPGUARD_INIT_SCLAE": "1024"})
    assert result.returncode == 0, result.stderr
    assert "error" not in result.stderr
    if json_flag:
        data = json.loads(result.stdout)
        assert_matches_docs(data, complete=False)
        assert data["config_problems"] == [] and data["config_error"] is None
        assert [w.split(" ")[0] for w in data["config_warnings"]] == ["AMPGUARD_INIT_SCLAE"]
    else:
        assert "configuration warning" in result.stdout and "configuration problem" not in result.stdout


def _check_exit_2_report(result: subprocess.CompletedProcess[str], json_flag: tuple[str, ...]) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("ampguard doctor: error: 1 bad AMPGUARD_* value")
    if json_flag:
        data = json.loads(result.stdout)  # stdout is the JSON object alone, the same fields as ever
        assert_matches_docs(data, complete=False)
        assert [problem.split("=")[0] for problem in data["config_problems"]] == ["AMPGUARD_INIT_SCALE"]
    else:
        assert "configuration problem" in result.stdout and "recommendation:" in result.stdout


def test_exit_status_2_with_a_bad_value_as_patches_exits():
    """Exit 2 for AMPGUARD_INIT_SCALE=abc, as ``ampguard patches`` does; the whole report is printed first.

    A fresh process: the status the shell sees, after the package's import under the bad value.
    """
    _check_exit_2_report(_run("--json", env={"AMPGUARD_QUIET": "1", "AMPGUARD_INIT_SCALE": "abc"}), ("--json",))


@pytest.mark.parametrize("json_flag", [(), ("--json",)])
def test_report_and_status_2_with_a_bad_value_as_patches(json_flag, ampguard_cli):
    """What ``ampguard doctor`` prints and returns for AMPGUARD_INIT_SCALE=abc, next to ``ampguard patches``."""
    bad = {"AMPGUARD_QUIET": "1", "AMPGUARD_INIT_SCALE": "abc"}
    result = ampguard_cli("doctor", *json_flag, env=bad)
    _check_exit_2_report(result, json_flag)
    assert ampguard_cli("patches", env=bad).returncode == result.returncode == 2
