"""Layout/exchange selection through the Python API and the environment."""

from __future__ import annotations

import os

import pytest

from sglang_frspec import FrSpecOptions, UnsupportedSetupError, set_options
from sglang_frspec.core.options import EXCHANGE_ENV, LAYOUT_ENV


def test_defaults_and_env(monkeypatch):
    monkeypatch.delenv(LAYOUT_ENV, raising=False)
    monkeypatch.delenv(EXCHANGE_ENV, raising=False)
    assert FrSpecOptions.from_env() == FrSpecOptions(layout="balanced", exchange="full")
    monkeypatch.setenv(LAYOUT_ENV, " Local ")
    assert FrSpecOptions.from_env().layout == "local"


def test_set_options_reaches_processes_started_later(monkeypatch):
    monkeypatch.delenv(LAYOUT_ENV, raising=False)
    monkeypatch.setenv(EXCHANGE_ENV, "topk")
    chosen = set_options(layout="local")
    assert chosen == FrSpecOptions(layout="local", exchange="topk")
    assert (os.environ[LAYOUT_ENV], os.environ[EXCHANGE_ENV]) == ("local", "topk")


@pytest.mark.parametrize(("field", "value"), [("layout", "diagonal"), ("exchange", "argmax")])
def test_unknown_values_are_rejected(field, value):
    with pytest.raises(UnsupportedSetupError, match=f"unknown {field} '{value}'"):
        set_options(**{field: value})
