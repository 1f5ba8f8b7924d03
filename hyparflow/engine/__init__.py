"""The training engine: pipeline schedules, stage execution and the training loop."""
