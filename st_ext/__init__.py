"""st_ext: sentence-transformers training that fits in memory.

Swap the import and keep the training script::

    from st_ext import SentenceTransformer, CrossEncoder, SentenceTransformerTrainer, CrossEncoderTrainer, losses
"""

from sentence_transformers import (
    CrossEncoderTrainingArguments,
    SentenceTransformerTrainingArguments,
)

from st_ext.models import CrossEncoder, SentenceTransformer
from st_ext.trainer import CrossEncoderTrainer, SentenceTransformerTrainer

__version__ = "0.1.0"

__all__ = [
    "CrossEncoder",
    "CrossEncoderTrainer",
    "CrossEncoderTrainingArguments",
    "SentenceTransformer",
    "SentenceTransformerTrainer",
    "SentenceTransformerTrainingArguments",
    "__version__",
]
