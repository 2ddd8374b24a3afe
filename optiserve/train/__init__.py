"""Data-parallel training (DDP under torchrun) that writes the checkpoints `optimize` consumes."""

from optiserve.train.trainer import TrainConfig, train

__all__ = ["TrainConfig", "train"]
