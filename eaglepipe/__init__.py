"""eaglepipe: a reproducible pipeline that trains EAGLE-3 draft models on a target's own tokens."""
