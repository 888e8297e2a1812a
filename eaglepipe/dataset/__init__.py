"""Prompts and training sequences: sources and formats, benchmarks, prepare, merge, sequences, shards."""
