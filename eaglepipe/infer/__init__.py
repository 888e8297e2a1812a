"""The infer stage: the resumable run over an engine, its answer cache and its quality gates."""
