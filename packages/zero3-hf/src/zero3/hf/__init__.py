"""zero3.hf: the transformers Trainer on zero3."""
