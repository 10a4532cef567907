"""Distillation of drafters (``specjax distill``): training data, batches, losses, the training
loop with its checkpoints, and export of the trained drafter."""
