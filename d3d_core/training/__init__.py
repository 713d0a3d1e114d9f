"""Training: distillation, the drafter recipe and its losses, soft labels, shortlists, offline τ, pruning, levers."""
