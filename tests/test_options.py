"""Layout/exchange selection through the Python API and the environment."""

from __future__ import annotations

import os

import pytest
import torch

from sglang_frspec import FrSpecOptions, UnsupportedSetupError, set_options
from sglang_frspec.core.options import EXCHANGE_ENV, LAYOUT_ENV


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


def test_auto_exchange_is_accepted(options_unset):
    assert set_options(exchange="auto").exchange == "auto"
    assert FrSpecOptions.from_env().exchange == "auto"


def test_auto_rule_picks_by_gathered_bytes_per_device():
    from sglang_frspec.core import plan_hot_shards
    from sglang_frspec.core.exchange_rule import DEFAULT_TOPK_MIN_GATHER_BYTES, auto_exchange

    plan = plan_hot_shards(torch.arange(0, 8000, 2), 8000, 2, layout="balanced")  # width 2000
    one = plan_hot_shards(plan.hot_ids, 8000, 1)
    assert auto_exchange(one, 64, 4, 4, "cpu") == "full"  # no collective: full is a slice
    assert auto_exchange(plan, 64, plan.num_hot, 4, "cpu") == "full"  # no valid packet (k >= H)
    assert [auto_exchange(plan, rows, 4, 4, "cpu") for rows in (1, 8, 64)] == ["topk"] * 3
    per_row = plan.gathered_bytes_per_row(2)  # bf16
    below = (DEFAULT_TOPK_MIN_GATHER_BYTES - 1) // per_row
    assert auto_exchange(plan, below, 4, 2, "cuda") == "full"
    assert auto_exchange(plan, below + 1, 4, 2, "cuda") == "topk"


def test_which_exchange_runs_fixed_fallback_and_auto():
    """The one decision the processor delegates: built with the requested exchange or the full
    fallback (k >= H, or k = 0), then per step the fixed one or auto's pick."""
    from sglang_frspec.core import plan_hot_shards
    from sglang_frspec.core.exchange_rule import exchange_at_start, exchange_for_step

    plan = plan_hot_shards(torch.arange(0, 8000, 2), 8000, 2, layout="balanced")  # H = 4000
    assert [exchange_at_start(e, plan, 4) for e in ("full", "topk", "auto")] == ["full", "topk", "auto"]
    for k in (0, plan.num_hot, plan.num_hot + 1):  # no valid top-k packet
        assert [exchange_at_start(e, plan, k) for e in ("full", "topk", "auto")] == ["full"] * 3
    assert exchange_for_step("topk", plan, 64, 4, 2, "cuda") == "topk"  # fixed: whatever the bytes
    assert exchange_for_step("full", plan, 64, 4, 4, "cpu") == "full"
    assert exchange_for_step("auto", plan, 1, 4, 4, "cpu") == "topk"  # auto: the rule's pick
    assert exchange_for_step("auto", plan, 1, 4, 2, "cuda") == "full"


def test_adaptation_options(options_unset):
    from sglang_frspec.core.options import ADAPT_ENV, ADAPT_INTERVAL_ENV, COVERAGE_ENV, DEFAULT_ADAPT_INTERVAL

    default = FrSpecOptions.from_env()
    assert (default.adapt, default.adapt_interval) == (False, DEFAULT_ADAPT_INTERVAL)
    options_unset.setenv(ADAPT_ENV, "1")
    options_unset.setenv(ADAPT_INTERVAL_ENV, " 16 ")
    assert (FrSpecOptions.from_env().adapt, FrSpecOptions.from_env().adapt_interval) == (True, 16)
    options_unset.setenv(ADAPT_INTERVAL_ENV, "often")
    with pytest.raises(UnsupportedSetupError, match="SGLANG_FRSPEC_ADAPT_INTERVAL='often': give the number"):
        FrSpecOptions.from_env()
    options_unset.setenv(ADAPT_INTERVAL_ENV, "0")
    with pytest.raises(UnsupportedSetupError, match="must be at least 1"):
        FrSpecOptions.from_env()
    options_unset.delenv(ADAPT_INTERVAL_ENV)
    options_unset.setenv(COVERAGE_ENV, "0")
    with pytest.raises(UnsupportedSetupError, match="follows the counts of the committed tokens"):
        FrSpecOptions.from_env()
    options_unset.delenv(COVERAGE_ENV)
    options_unset.delenv(ADAPT_ENV)
    chosen = set_options(adapt=True, adapt_interval=8)
    assert (chosen.adapt, chosen.adapt_interval) == (True, 8) and FrSpecOptions.from_env() == chosen
    assert (os.environ[ADAPT_ENV], os.environ[ADAPT_INTERVAL_ENV]) == ("1", "8")
