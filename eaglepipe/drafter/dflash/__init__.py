"""DFlash: a block drafter (Qwen3 layers over the target's aux states as context), its config and its objective."""
