"""The models and their bundles: the target (fast CPU path), the drafters, checkpoints, tokenizers."""
