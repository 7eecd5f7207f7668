"""The training loop: trainer, training-time test, losses, metrics, logs, checkpoints, processes."""
