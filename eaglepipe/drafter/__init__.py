"""The drafter: one folder per algorithm, and the training run."""
