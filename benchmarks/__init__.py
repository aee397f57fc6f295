"""The benchmarks a user runs from the repository root: ``python -m benchmarks.<name>``."""
