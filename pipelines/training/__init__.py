"""Training and distillation: the settings, the trainer, its objective and losses, FP8, and the resumable DCP checkpoints."""
