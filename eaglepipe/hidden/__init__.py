"""The hidden stage: the states' layout, their extraction, and the vLLM states source with its connector."""
