"""The computation: models, losses, optimizers, SAM, the training step and the evaluation."""
