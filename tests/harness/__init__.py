"""Test and benchmark harness (never shipped): zygote-forked processes, real TP groups, the
trained and EAGLE-3 fixtures, greedy references. The repository root must be importable."""
