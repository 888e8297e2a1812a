"""EAGLE-3: the drafter model, its start from the target's weights, the training-time-test objective."""
