"""st_ext: sentence-transformers training that fits in memory.

Swap the import and keep the training script::

    from st_ext import SentenceTransformer, CrossEncoder, SentenceTransformerTrainer, CrossEncoderTrainer, losses

``SparseEncoder`` (sentence-transformers 5.0+) and ``MultiVectorEncoder`` (6.0+), with their trainers and
training arguments, are here too where the installed release has them; on an older release importing
one raises an ImportError naming the release it needs.
"""

from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _distribution_version

from sentence_transformers import (
    CrossEncoderTrainingArguments,
    SentenceTransformerTrainingArguments,
)

from st_ext import _compat
from st_ext.models import CrossEncoder, SentenceTransformer
from st_ext.training.trainer import CrossEncoderTrainer, SentenceTransformerTrainer

try:
    #: The installed distribution's version (pyproject.toml is the one place it is written).
    __version__ = _distribution_version("st-ext")
except _PackageNotFoundError:  # a source tree on sys.path without `pip install -e .`
    __version__ = "0+unknown"

__all__ = [
    "CrossEncoder",
    "CrossEncoderTrainer",
    "CrossEncoderTrainingArguments",
    "SentenceTransformer",
    "SentenceTransformerTrainer",
    "SentenceTransformerTrainingArguments",
    "__version__",
]

if _compat.HAS_SPARSE_ENCODER:
    from sentence_transformers import SparseEncoderTrainingArguments

    from st_ext.models import SparseEncoder
    from st_ext.training.trainer import SparseEncoderTrainer

    __all__ += ["SparseEncoder", "SparseEncoderTrainer", "SparseEncoderTrainingArguments"]

if _compat.HAS_MULTI_VECTOR_ENCODER:
    from sentence_transformers import MultiVectorEncoderTrainingArguments

    from st_ext.models import MultiVectorEncoder
    from st_ext.training.trainer import MultiVectorEncoderTrainer

    __all__ += ["MultiVectorEncoder", "MultiVectorEncoderTrainer", "MultiVectorEncoderTrainingArguments"]


def __getattr__(name: str):
    """Name the sentence-transformers release an archetype needs when the installed one lacks it."""
    error = _compat.missing_archetype_error(name)
    if error is not None:
        raise error
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
