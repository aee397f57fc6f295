"""The multi-rank harness itself: a group's rendezvous outlives its fastest rank."""

from __future__ import annotations

import pytest

from tests import rank_cases
from tests.harness.tp_group import run_tp_group

pytestmark = pytest.mark.multirank


def test_ranks_still_rendezvousing_when_rank0_returns_do_not_lose_the_store():
    """Rank 0 serves the group's TCPStore: if it exited once its own function returned, ranks
    still creating groups through the store failed with ``DistNetworkError`` ("Connection reset
    by peer" or "Broken pipe"): the flaky TP=4 failure inside ``initialize_model_parallel``, where
    rank 0 leaves the last groups' rendezvous early. Every rank now waits for the others."""
    assert run_tp_group(rank_cases.store_after_rank0_returns, 3, {"delay": 8.0}) == [0, 1, 2]
