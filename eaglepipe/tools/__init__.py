"""Commands outside every stage: make repro, make plan, make inspect."""
