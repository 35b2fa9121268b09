"""What a run leaves: its identity, run folder, lock, checkpoints, tracking, predictions."""
