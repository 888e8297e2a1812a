"""The infer stage: the resumable run over an engine and its quality gates."""
