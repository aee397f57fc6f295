"""Test support: CPU environment, tiny fixtures, real-server and real-TP-group harnesses.

Used by the tests, the benchmarks and ``sglang-frspec demo``; never by the plugin at serve time.
"""
