"""Configuration from the environment: every variable parsed, every bad value a ConfigError."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ampguard import ConfigError
from ampguard.config import SETTINGS, load, markdown_table

PATCHES = ("autocast", "grad_scaler", "clip_grad", "anomaly")
DOCS = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


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
        ("AMPGUARD_INIT_SCALE", "big", "finite number >= 1"),
        ("AMPGUARD_INIT_SCALE", "0.5", "finite number >= 1"),
        ("AMPGUARD_INIT_SCALE", "inf", "finite number >= 1"),
        ("AMPGUARD_GROWTH_INTERVAL", "1.5", "whole number >= 1"),
        ("AMPGUARD_GROWTH_INTERVAL", "0", "whole number >= 1"),
        ("AMPGUARD_MIN_SCALE", "-1", "or 0 for no floor"),
        ("AMPGUARD_STATS_EVERY", "-5", "whole number >= 0"),
        ("AMPGUARD_ON_STALL", "explode", "'warn' or 'raise'"),
        ("AMPGUARD_FP16_GRADS", "maybe", "'allow' or 'error'"),
    ],
)
def test_bad_values_name_variable_value_and_what_is_accepted(variable, raw, accepted_fragment):
    with pytest.raises(ConfigError) as caught:
        load({variable: raw}, patch_names=PATCHES)
    message = str(caught.value)
    assert variable in message and repr(raw) in message and accepted_fragment in message
    assert caught.value.variable == variable and caught.value.value == raw


def test_unknown_patch_name_suggests_the_close_one():
    with pytest.raises(ConfigError) as caught:
        load({"AMPGUARD_DISABLE": "clipgrad"}, patch_names=PATCHES)
    message = str(caught.value)
    assert "AMPGUARD_DISABLE" in message and "'clipgrad'" in message
    assert "Did you mean 'clip_grad'?" in message
    assert "autocast, grad_scaler, clip_grad, anomaly" in message


def test_unknown_variable_is_an_error_with_suggestion():
    with pytest.raises(ConfigError) as caught:
        load({"AMPGUARD_INIT_SCAL": "4096"}, patch_names=PATCHES)
    assert "AMPGUARD_INIT_SCAL" in str(caught.value) and "Did you mean 'AMPGUARD_INIT_SCALE'?" in str(caught.value)


def test_choice_misspelling_gets_a_suggestion():
    with pytest.raises(ConfigError, match="Did you mean 'raise'"):
        load({"AMPGUARD_ON_STALL": "rasie"}, patch_names=PATCHES)


def test_docs_table_is_generated_from_the_settings():
    assert markdown_table() in DOCS.read_text(), (
        "docs/configuration.md is out of date: regenerate its table with "
        "python -c 'from ampguard.config import markdown_table; print(markdown_table())'"
    )


def test_every_variable_the_code_reads_is_a_setting():
    root = Path(__file__).resolve().parents[1] / "ampguard"
    read = set()
    for path in root.rglob("*.py"):
        read |= set(re.findall(r"[\"'](AMPGUARD(?:_[A-Z0-9]+)*)[\"']", path.read_text()))
    assert read <= {s.variable for s in SETTINGS}, read - {s.variable for s in SETTINGS}


def test_bad_value_raises_from_import_ampguard():
    result = subprocess.run(
        [sys.executable, "-c", "import ampguard"],
        env={"PATH": "", "AMPGUARD_STATS_EVERY": "often"},
        capture_output=True, text=True,
    )
    assert result.returncode == 1
    assert "ampguard.errors.ConfigError: AMPGUARD_STATS_EVERY='often' is not valid" in result.stderr
