"""Layout/exchange selection through the Python API and the environment."""

from __future__ import annotations

import os

import pytest

from sglang_frspec import FrSpecOptions, UnsupportedSetupError, set_options
from sglang_frspec.core.options import EXCHANGE_ENV, LAYOUT_ENV


@pytest.fixture
def options_unset(monkeypatch):
    """Both option variables unset for the test and restored after it, even when the test (or
    ``set_options``) writes them: ``delenv`` alone records nothing for a variable that is not set,
    so ``setenv`` first makes monkeypatch remember the variable's prior state."""
    for name in (LAYOUT_ENV, EXCHANGE_ENV):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


def test_defaults_and_env(options_unset):
    assert FrSpecOptions.from_env() == FrSpecOptions(layout="balanced", exchange="full")
    options_unset.setenv(LAYOUT_ENV, " Local ")
    assert FrSpecOptions.from_env().layout == "local"


def test_set_options_reaches_processes_started_later(options_unset):
    options_unset.setenv(EXCHANGE_ENV, "topk")
    chosen = set_options(layout="local")
    assert chosen == FrSpecOptions(layout="local", exchange="topk")
    assert (os.environ[LAYOUT_ENV], os.environ[EXCHANGE_ENV]) == ("local", "topk")


@pytest.mark.parametrize(("field", "value"), [("layout", "diagonal"), ("exchange", "argmax")])
def test_unknown_values_are_rejected(options_unset, field, value):
    with pytest.raises(UnsupportedSetupError, match=f"unknown {field} '{value}'"):
        set_options(**{field: value})
    assert LAYOUT_ENV not in os.environ and EXCHANGE_ENV not in os.environ  # nothing half-written
