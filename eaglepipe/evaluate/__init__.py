"""The evaluate and serve stages: speculative decoding, the evaluation run, the vLLM serve check."""
