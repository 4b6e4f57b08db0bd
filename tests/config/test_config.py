"""Configuration from the environment: every variable parsed, every bad value a ConfigError."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
from scaler_support import ampguard_log, records  # noqa: F401  (a fixture)

import ampguard.config.names
from ampguard import ConfigError
from ampguard.config import SETTINGS, load, markdown_table

PATCHES = ("autocast", "grad_scaler", "clip_grad", "anomaly")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_defaults_come_from_the_settings_table():
    config = load({}, patch_names=PATCHES)
    for setting in SETTINGS:
        assert getattr(config, setting.attribute) == setting.default, setting.variable


@pytest.mark.parametrize(
    ("variable", "raw", "attribute", "expected"),
    [
        ("AMPGUARD", "0", "enabled", False),
        ("AMPGUARD", "off", "enabled", False),
        ("AMPGUARD_QUIET", "yes", "quiet", True),
        ("AMPGUARD_DISABLE", " Clip_Grad , autocast ", "disable", frozenset({"clip_grad", "autocast"})),
        ("AMPGUARD_ENABLE", "anomaly", "enable", frozenset({"anomaly"})),
        ("AMPGUARD_INIT_SCALE", "4096", "init_scale", 4096.0),
        ("AMPGUARD_GROWTH_INTERVAL", "250", "growth_interval", 250),
        ("AMPGUARD_MAX_SCALE", "65536", "max_scale", 65536.0),
        ("AMPGUARD_MIN_SCALE", "0", "min_scale", 0.0),
        ("AMPGUARD_MIN_SCALE", "0.25", "min_scale", 0.25),
        ("AMPGUARD_MAX_CONSECUTIVE_SKIPS", "7", "max_consecutive_skips", 7),
        ("AMPGUARD_ON_STALL", "RAISE", "on_stall", "raise"),
        ("AMPGUARD_STATS_EVERY", "0", "stats_every", 0),
        ("AMPGUARD_FP16_GRADS", "error", "fp16_grads", "error"),
        ("AMPGUARD_BF16_FALLBACK", "fp16", "bf16_fallback", "fp16"),
    ],
)
def test_each_variable_is_parsed(variable, raw, attribute, expected):
    assert getattr(load({variable: raw}, patch_names=PATCHES), attribute) == expected


def test_empty_value_means_default():
    assert load({"AMPGUARD_INIT_SCALE": ""}, patch_names=PATCHES).init_scale is None


@pytest.mark.parametrize(
    ("variable", "raw", "accepted_fragment"),
    [
        ("AMPGUARD", "maybe", "1/true/yes/on"),
        ("AMPGUARD_INIT_SCALE", "big", "finite number from 1 to 3.4028234663852886e38"),
        ("AMPGUARD_INIT_SCALE", "0.5", "finite number from 1 to"),
        ("AMPGUARD_INIT_SCALE", "inf", "finite number from 1 to"),
        # What torch can hold: the scale is float32, the growth tracker int32, device-mode streaks float32.
        ("AMPGUARD_INIT_SCALE", "1e39", "the largest float32"),
        ("AMPGUARD_MAX_SCALE", "1e39", "the largest float32"),
        ("AMPGUARD_MIN_SCALE", "1e39", "or 0 for no floor"),
        ("AMPGUARD_GROWTH_INTERVAL", "1.5", "whole number from 1 to 2147483647"),
        ("AMPGUARD_GROWTH_INTERVAL", "0", "whole number from 1 to 2147483647"),
        ("AMPGUARD_GROWTH_INTERVAL", "2147483648", "the int32 growth tracker"),
        ("AMPGUARD_MAX_CONSECUTIVE_SKIPS", "16777217", "from 1 to 16777216"),
        ("AMPGUARD_MIN_SCALE", "-1", "or 0 for no floor"),
        ("AMPGUARD_STATS_EVERY", "-5", "whole number >= 0"),
        ("AMPGUARD_ON_STALL", "explode", "'warn' or 'raise'"),
        ("AMPGUARD_FP16_GRADS", "maybe", "'allow' or 'error'"),
        ("AMPGUARD_FP32_ISLANDS", "on", "'auto' or 'report'"),
        ("AMPGUARD_MAX_ISLANDS", "0", "a whole number >= 1"),
        ("AMPGUARD_MAX_ISLANDS", "many", "a whole number >= 1"),
        ("AMPGUARD_PROBE_STEPS", "-5", "a whole number >= 1"),
        ("AMPGUARD_PROBE_STEPS", "1.5", "a whole number >= 1"),
    ],
)
def test_bad_values_name_variable_value_and_what_is_accepted(variable, raw, accepted_fragment):
    with pytest.raises(ConfigError) as caught:
        load({variable: raw}, patch_names=PATCHES)
    message = str(caught.value)
    assert variable in message and repr(raw) in message and accepted_fragment in message
    assert caught.value.variable == variable and caught.value.value == raw


def test_accepted_extremes_are_accepted():
    config = load(
        {
            "AMPGUARD_MAX_SCALE": "3.4028234663852886e38",
            "AMPGUARD_GROWTH_INTERVAL": "2147483647",
            "AMPGUARD_MAX_CONSECUTIVE_SKIPS": "16777216",
            "AMPGUARD_MIN_SCALE": "1e-30",
        },
        patch_names=PATCHES,
    )
    assert (config.max_scale, config.growth_interval, config.min_scale) == (3.4028234663852886e38, 2**31 - 1, 1e-30)


@pytest.mark.parametrize(
    ("environ", "value"),
    [
        ({"AMPGUARD_MIN_SCALE": "100", "AMPGUARD_MAX_SCALE": "10"}, "100"),
        ({"AMPGUARD_MIN_SCALE": "1e30"}, "1e30"),  # above the default cap 2**24
        ({"AMPGUARD_MAX_SCALE": "0.5"}, None),  # below 1: the cap's own error
    ],
)
def test_floor_above_the_cap_is_an_error(environ, value):
    with pytest.raises(ConfigError) as caught:
        load(environ, patch_names=PATCHES)
    if value is None:
        assert caught.value.variable == "AMPGUARD_MAX_SCALE"
        return
    assert caught.value.variable == "AMPGUARD_MIN_SCALE" and caught.value.value == value
    cap = float(environ.get("AMPGUARD_MAX_SCALE", 2**24))
    assert f"no higher than the cap, AMPGUARD_MAX_SCALE={cap:.10g}" in str(caught.value)


def test_unknown_patch_name_suggests_the_close_one():
    with pytest.raises(ConfigError) as caught:
        load({"AMPGUARD_DISABLE": "clipgrad"}, patch_names=PATCHES)
    message = str(caught.value)
    assert "AMPGUARD_DISABLE" in message and "'clipgrad'" in message
    assert "Did you mean 'clip_grad'?" in message
    assert "autocast, grad_scaler, clip_grad, anomaly" in message


@pytest.mark.parametrize(
    ("variable", "suggestion"),
    [
        ("AMPGUARD_INIT_SCAL", "Did you mean AMPGUARD_INIT_SCALE?"),  # by spelling
        ("AMPGUARD_QUITE", "Did you mean AMPGUARD_QUIET?"),
        ("AMPGUARD_PATCHES", "Did you mean AMPGUARD_DISABLE or AMPGUARD_ENABLE?"),  # by meaning
        ("AMPGUARD_SKIP_PATCH", "Did you mean AMPGUARD_DISABLE or AMPGUARD_ENABLE?"),
        ("AMPGUARD_LOSS_SCALE", "Did you mean AMPGUARD_INIT_SCALE or AMPGUARD_MIN_SCALE or AMPGUARD_MAX_SCALE?"),
        # Lower case and malformed names: warned, never silently ignored.
        ("ampguard_init_scale", "Did you mean AMPGUARD_INIT_SCALE?"),
        ("AMPGUARDINIT_SCALE", "Did you mean AMPGUARD_INIT_SCALE?"),
        ("AMPGUARD__INIT_SCALE", "Did you mean AMPGUARD_INIT_SCALE?"),
        ("Ampguard_Quite", "Did you mean AMPGUARD_QUIET?"),
        ("ampguard", "Did you mean AMPGUARD?"),
        ("AMPGUARD_CHECKOUT", None),  # a harness's own variable
    ],
)
def test_unknown_variable_is_a_warning_with_a_suggestion_and_the_run_goes_on(
    variable, suggestion, ampguard_log, monkeypatch
):
    monkeypatch.setattr(ampguard.config.names, "_warned", set())
    config = load({variable: "secret-token"}, patch_names=PATCHES)
    assert config == load({}, patch_names=PATCHES)  # ignored: the defaults
    [warning] = records(ampguard_log, logging.WARNING, "not an ampguard variable")
    message = warning.getMessage()
    assert message.startswith(f"{variable} is not an ampguard variable; ampguard ignores it.")
    assert "secret-token" not in message  # the value of a variable that is not ours may be anything
    if suggestion is None:
        assert "Did you mean" not in message and "`ampguard doctor` lists the known ones" in message
    else:
        assert message.endswith(suggestion)


def test_an_unknown_variable_is_warned_once_per_process(ampguard_log, monkeypatch):
    monkeypatch.setattr(ampguard.config.names, "_warned", set())
    for _ in range(3):  # install, the CLI's check and the doctor each read the environment
        load({"AMPGUARD_CHECKOUT": "/src", "ampguard_quiet": "1"}, patch_names=PATCHES)
    warned = [r.getMessage().split()[0] for r in records(ampguard_log, logging.WARNING, "not an ampguard variable")]
    assert warned == ["AMPGUARD_CHECKOUT", "ampguard_quiet"]


def test_other_names_are_not_ampguards_business(ampguard_log, monkeypatch):
    monkeypatch.setattr(ampguard.config.names, "_warned", set())
    load({"MY_AMPGUARD_X": "1", "PATH": "/bin"}, patch_names=PATCHES)
    assert records(ampguard_log, logging.WARNING) == []


def test_every_bad_variable_is_named_in_one_error():
    environ = {"AMPGUARD_INIT_SCALE": "abc", "AMPGUARD_ON_STALL": "explode", "AMPGUARD_MAX_ISLANDS": "0"}
    with pytest.raises(ConfigError) as caught:
        load(environ, patch_names=PATCHES)
    error = caught.value
    assert [(p.variable, p.value) for p in error.problems] == [
        ("AMPGUARD_INIT_SCALE", "abc"),
        ("AMPGUARD_ON_STALL", "explode"),
        ("AMPGUARD_MAX_ISLANDS", "0"),
    ]
    assert (error.variable, error.value) == ("AMPGUARD_INIT_SCALE", "abc")  # the first one's, as with one
    lines = str(error).splitlines()
    assert lines[0] == "3 AMPGUARD_* variables are not valid:"
    assert lines[1:] == [f"  {problem}" for problem in error.problems]
    assert "AMPGUARD_ON_STALL='explode' is not valid" in lines[2]


def test_one_bad_variable_is_one_line():
    with pytest.raises(ConfigError) as caught:
        load({"AMPGUARD_INIT_SCALE": "abc"}, patch_names=PATCHES)
    assert caught.value.problems == (caught.value,) and "\n" not in str(caught.value)


@pytest.mark.parametrize("raw", ["off", "OFF", "false", "0", "no", "disable", "none"])
def test_a_patch_mode_switched_off_points_to_the_disable_switch(raw):
    with pytest.raises(ConfigError) as caught:
        load({"AMPGUARD_FP32_ISLANDS": raw}, patch_names=PATCHES)
    assert str(caught.value).endswith("To switch the fp32_islands patch off, set AMPGUARD_DISABLE=fp32_islands.")


@pytest.mark.parametrize(("variable", "raw"), [("AMPGUARD_MASTER_WEIGHTS", "no"), ("AMPGUARD_BF16_FALLBACK", "false")])
def test_a_mode_that_has_off_suggests_it(variable, raw):
    with pytest.raises(ConfigError) as caught:
        load({variable: raw}, patch_names=PATCHES)
    assert str(caught.value).endswith("Did you mean 'off'?")


def test_choice_misspelling_gets_a_suggestion():
    with pytest.raises(ConfigError, match="Did you mean 'raise'"):
        load({"AMPGUARD_ON_STALL": "rasie"}, patch_names=PATCHES)


def test_docs_table_is_generated_from_the_settings():
    assert markdown_table() in DOCS.read_text(), (
        "docs/configuration.md is out of date: regenerate its table with "
        "python -c 'from ampguard.config import markdown_table; print(markdown_table())'"
    )


def test_every_variable_the_code_reads_is_a_setting():
    root = Path(__file__).resolve().parents[2] / "ampguard"
    read = set()
    for path in root.rglob("*.py"):
        read |= set(re.findall(r"[\"'](AMPGUARD(?:_[A-Z0-9]+)*)[\"']", path.read_text()))
    assert read <= {s.variable for s in SETTINGS}, read - {s.variable for s in SETTINGS}


# The import under a bad variable (a ConfigError, retried, who counts as the command): test_import_config_error.py.
def _import_ampguard(code: str, **variables: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], env={"PATH": "", **variables}, capture_output=True, text=True, timeout=300
    )


def test_an_unknown_variable_at_import_is_a_warning_and_the_script_runs():
    result = _import_ampguard("import ampguard; print(ampguard.status()[0].state)", AMPGUARD_CHECKOUT="/src")
    assert result.returncode == 0 and result.stdout == "applied\n", result.stderr
    assert result.stderr.startswith("ampguard WARNING: AMPGUARD_CHECKOUT is not an ampguard variable")
