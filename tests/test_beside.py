"""The run beside (tests/harness/beside.py) reads every outcome of a real second pytest back."""

from __future__ import annotations

import textwrap

from tests.harness.beside import CHILD_VARIABLE, BesideRun

SAMPLE = """
import os
import pytest

def test_passes_in_the_run_beside():
    assert os.environ["{variable}"] == "1"

def test_fails():
    assert 2 + 2 == 5, "arithmetic"

def test_skips():
    pytest.skip("not here")

@pytest.mark.parametrize("n", [1, 2])
def test_param(n):
    assert n == 1
"""


def test_outcomes_of_the_run_beside_are_read_back_by_node_id(tmp_path):
    (tmp_path / "test_sample.py").write_text(textwrap.dedent(SAMPLE.format(variable=CHILD_VARIABLE)))
    names = ["test_passes_in_the_run_beside", "test_fails", "test_skips", "test_param[1]", "test_param[2]"]
    run = BesideRun([f"test_sample.py::{name}" for name in names], tmp_path / "beside", root=tmp_path)
    run.start()
    outcomes = {name: run.outcome(f"test_sample.py::{name}") for name in names}
    assert {name: outcome for name, (outcome, _) in outcomes.items()} == {
        "test_passes_in_the_run_beside": "passed",
        "test_fails": "failed",
        "test_skips": "skipped",
        "test_param[1]": "passed",
        "test_param[2]": "failed",
    }
    assert "arithmetic" in outcomes["test_fails"][1] and "not here" in outcomes["test_skips"][1]
    assert set(run.seconds()) == {f"test_sample.py::{name}" for name in names}
    # A test the run never reached reads as missing, with the run's log.
    outcome, text = run.outcome("test_sample.py::test_absent")
    assert outcome == "missing" and "2 failed, 2 passed, 1 skipped" in text
