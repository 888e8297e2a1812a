"""Test doubles the tests and benchmarks share (no stage imports them)."""
