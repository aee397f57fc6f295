"""Test harness (never shipped): real TP groups, the random and EAGLE-3 fixtures, the sampling
law, test-only SGLang plugins. The repository root must be importable. What benchmarks and scripts
share with the tests (the zygote, greedy references, the trained fixture) lives in ``tools/``,
which never imports this."""
