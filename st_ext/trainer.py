"""Kept for existing imports: the trainers live in :mod:`st_ext.training.trainer`."""

from st_ext.training import trainer as _home
from st_ext.training.trainer import (  # noqa: F401
    CheckpointingTrainerMixin,
    CrossEncoderTrainer,
    ResidentFrozenEncodersMixin,
    SentenceTransformerTrainer,
    lend_checkpointing_methods,
    resolve_loss_names,
)


def __getattr__(name: str):
    # The rest from the new home: the trainers of newer archetypes, or the error naming the release they need.
    return getattr(_home, name)
