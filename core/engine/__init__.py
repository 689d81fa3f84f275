"""The training engine: :class:`~crosstrain.engine.trainer.Trainer` and its metrics."""

from crosstrain.engine.trainer import Trainer, TrainingError

__all__ = ["Trainer", "TrainingError"]
