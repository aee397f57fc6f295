"""The timed runs' schedule and the rule that refuses a ratio to a drifting reference
(``sglang_frspec.demo.timing``; no servers: the scheduler and the rule are pure)."""

from __future__ import annotations

import pytest

from sglang_frspec.demo.timing import (
    MAX_REFERENCE_DRIFT,
    drift,
    interleaved_rounds,
    ratio_refusal,
    round_order,
)


def test_rounds_alternate_the_systems_and_run_the_reference_again_last():
    """Each round runs every system in the order given; the first (plain) also closes the run, so
    it brackets every other system's runs; each system's samples come back in its run order."""
    calls = []

    def run(name: str) -> dict:
        calls.append(name)
        return {"call": len(calls)}

    samples = interleaved_rounds(run, ["plain", "stock", "plugin"], rounds=2)
    assert calls == ["plain", "stock", "plugin", "plain", "stock", "plugin", "plain"]
    assert samples == {
        "plain": [{"call": 1}, {"call": 4}, {"call": 7}],
        "stock": [{"call": 2}, {"call": 5}],
        "plugin": [{"call": 3}, {"call": 6}],
    }
    assert round_order(["plain"], 3) == ["plain"] * 3  # alone: nothing to bracket


def test_a_ratio_is_refused_when_the_reference_drifted_more_than_the_share():
    assert drift([10.0, 11.0, 10.5]) == pytest.approx(0.1)
    assert drift([4.0]) == 0.0
    assert ratio_refusal([10.0, 10.9, 10.4]) is None  # 9% apart: within the default 10%
    reason = ratio_refusal([4.5, 3.9, 4.4])  # the host: 15% apart
    assert reason is not None and "15%" in reason and f"{MAX_REFERENCE_DRIFT:.0%}" in reason
    assert ratio_refusal([4.5, 3.9, 4.4], max_drift=0.2) is None  # the share is an option
    assert "once" in ratio_refusal([4.5])  # one run: its drift is unknown, no ratio
