"""Training: the recipe (`TrainConfig`), the optimizer and schedules, the one `Trainer`, plots."""

from .config import TrainConfig
from .optim import lr_at, make_optimizer
from .plots import plot_loss_curve
from .trainer import Trainer, TrainingInterrupted

__all__ = ["TrainConfig", "Trainer", "TrainingInterrupted", "lr_at", "make_optimizer", "plot_loss_curve"]
