"""Stock SGLang 0.5.23 (this plugin excluded through SGLANG_PLUGINS): what the plugin fixes.

These keep documenting upstream behaviour after the fix; if one starts failing, SGLang changed.
What stock does serve is asserted where it is the reference: TP=1 with a map in
tests/test_servers_plugin.py::test_plugin_matches_stock_tp1 (and on the trained model in
tests/test_trained.py), TP=2 without a map in tests/test_cli.py::test_demo_main_job.
"""

from __future__ import annotations

import pytest

from sglang_frspec.demo.server import ServerError

pytestmark = [pytest.mark.server, pytest.mark.stock]
NEW = 24


def test_stock_tp2_map_on_both_halves_crashes_in_init_lm_head(perm, start_server):
    server = start_server(perm, 2, perm.token_map("hot"), plugin=False, wait=False)
    with pytest.raises(ServerError, match="exited"):
        server.wait_ready()
    log = server.log_path.read_text()
    assert "init_lm_head" in log and "IndexError: index" in log
    assert "sglang-frspec:" not in log and "frspec_worker" not in log  # plugin excluded


def test_stock_tp2_map_below_half_crashes_at_the_first_request(perm, start_server):
    server = start_server(perm, 2, perm.token_map("hot_low"), plugin=False)
    with pytest.raises(Exception):  # noqa: B017 - the server dies mid-request
        server.generate(list(perm.low_chain[:3]), NEW)
    log = server.log_path.read_text()
    assert "draft_forward" in log and "IndexError: index" in log
