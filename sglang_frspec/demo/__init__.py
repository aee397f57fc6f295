"""What ``sglang-frspec demo`` runs on: SGLang's CPU environment (``cpu``, ``cpu_site/``), the tiny
permutation fixture (``fixtures``) and a real-server helper (``server``).

The tests and benchmarks use it too; the plugin never imports it at serve time.
"""
