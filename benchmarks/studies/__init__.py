"""Studies bound to the CPU fixtures (``python -m benchmarks.studies.<name>``); results in docs/results."""
