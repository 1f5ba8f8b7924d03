"""ZeRO-1: each of a stage's replicas keeps and updates a slice of its optimizer state; where
the slices lie, what checkpoints see of them, and which optimizers it can shard exactly."""
