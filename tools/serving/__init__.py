"""Serving helpers for tests and benchmarks: forked server launches, greedy references and checks."""
