"""Benchmark harness (not run by the test suite): generation speed and the KV store."""
