"""st_ext: sentence-transformers training that fits in memory.

Swap the import and keep the training script::

    from st_ext import SentenceTransformer, CrossEncoder, SentenceTransformerTrainer, CrossEncoderTrainer, losses

``SparseEncoder`` (sentence-transformers 5.0+) and ``MultiVectorEncoder`` (6.0+), with their trainers, are here
where the installed release has them. The other top-level names of sentence-transformers (``InputExample``,
``util``, the training arguments…) are here too, as upstream's own objects; module paths that st_ext does not
have (``sentence_transformers.evaluation``…) are imported from ``sentence_transformers``.

Every name is listed below for type checkers and loads on first use (:data:`_SOURCES`), so that
``st-ext --help`` answers without importing torch.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError as _PackageNotFoundError, version as _distribution_version
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sentence_transformers import (
        CrossEncoderModelCardData as CrossEncoderModelCardData,
        CrossEncoderTrainingArguments as CrossEncoderTrainingArguments,
        DefaultBatchSampler as DefaultBatchSampler,
        InputExample as InputExample,
        LoggingHandler as LoggingHandler,
        MultiDatasetDefaultBatchSampler as MultiDatasetDefaultBatchSampler,
        MultiVectorEncoderModelCardData as MultiVectorEncoderModelCardData,
        MultiVectorEncoderTrainingArguments as MultiVectorEncoderTrainingArguments,
        ParallelSentencesDataset as ParallelSentencesDataset,
        SentencesDataset as SentencesDataset,
        SentenceTransformerTrainingArguments as SentenceTransformerTrainingArguments,
        SimilarityFunction as SimilarityFunction,
        SparseEncoderModelCardData as SparseEncoderModelCardData,
        SparseEncoderTrainingArguments as SparseEncoderTrainingArguments,
        export_dynamic_quantized_onnx_model as export_dynamic_quantized_onnx_model,
        export_optimized_onnx_model as export_optimized_onnx_model,
        export_static_quantized_openvino_model as export_static_quantized_openvino_model,
        mine_hard_negatives as mine_hard_negatives,
        quantize_embeddings as quantize_embeddings,
        resolve_ids as resolve_ids,
        util as util,
    )

    from st_ext import losses as losses, models as models
    from st_ext.model_card import SentenceTransformerModelCardData as SentenceTransformerModelCardData
    from st_ext.models import (
        CrossEncoder as CrossEncoder,
        MultiVectorEncoder as MultiVectorEncoder,
        SentenceTransformer as SentenceTransformer,
        SparseEncoder as SparseEncoder,
    )
    from st_ext.training.memory_checkpoints import CrossBatchMemoryCallback as CrossBatchMemoryCallback
    from st_ext.training.trainer import (
        CrossEncoderTrainer as CrossEncoderTrainer,
        MultiVectorEncoderTrainer as MultiVectorEncoderTrainer,
        SentenceTransformerTrainer as SentenceTransformerTrainer,
        SparseEncoderTrainer as SparseEncoderTrainer,
    )

try:
    #: The installed distribution's version (pyproject.toml is the one place it is written).
    __version__ = _distribution_version("st-ext")
except _PackageNotFoundError:  # a source tree on sys.path without `pip install -e .`
    __version__ = "0+unknown"

_ARCHETYPES = ("SentenceTransformer", "CrossEncoder", "SparseEncoder", "MultiVectorEncoder")
#: Upstream's top-level names that st_ext offers as they are (those the installed release has).
_UPSTREAM_NAMES = (
    "CrossEncoderModelCardData",
    "DefaultBatchSampler",
    "InputExample",
    "LoggingHandler",
    "MultiDatasetDefaultBatchSampler",
    "MultiVectorEncoderModelCardData",
    "ParallelSentencesDataset",
    "SentencesDataset",
    "SimilarityFunction",
    "SparseEncoderModelCardData",
    "export_dynamic_quantized_onnx_model",
    "export_optimized_onnx_model",
    "export_static_quantized_openvino_model",
    "mine_hard_negatives",
    "quantize_embeddings",
    "resolve_ids",
    "util",
)
#: Each public name and the module it comes from: st_ext's models, trainers, model card data and cross-batch memory
#: callback, upstream's training arguments and other names; ``losses`` and ``models`` are st_ext's own modules.
_SOURCES = {
    **{archetype: "st_ext.models" for archetype in _ARCHETYPES},
    **{archetype + "Trainer": "st_ext.training.trainer" for archetype in _ARCHETYPES},
    **{archetype + "TrainingArguments": "sentence_transformers" for archetype in _ARCHETYPES},
    "SentenceTransformerModelCardData": "st_ext.model_card",
    "CrossBatchMemoryCallback": "st_ext.training.memory_checkpoints",
    **{name: "sentence_transformers" for name in _UPSTREAM_NAMES},
}
_SUBMODULES = ("losses", "models")


def _has(name: str) -> bool:
    """Whether the installed sentence-transformers release has public name ``name`` (and so st_ext does)."""
    from st_ext import _compat

    if _compat.missing_archetype_error(name) is not None:
        return False
    return _SOURCES[name] != "sentence_transformers" or hasattr(importlib.import_module("sentence_transformers"), name)


def _public_names() -> list[str]:
    return sorted([name for name in _SOURCES if _has(name)] + list(_SUBMODULES)) + ["__version__"]


if not TYPE_CHECKING:  # a type checker reads the names above; an unknown name is its error, not `object`

    def __getattr__(name: str) -> object:
        """Load a public name on first use (see :data:`_SOURCES`); name the release an archetype needs where the
        installed one lacks it."""
        if name == "__all__":
            return _public_names()
        if name in _SUBMODULES:
            return importlib.import_module(f"{__name__}.{name}")
        if name in _SOURCES:
            from st_ext import _compat

            error = _compat.missing_archetype_error(name)
            if error is not None:
                raise error
            module = importlib.import_module(_SOURCES[name])
            if not hasattr(module, name):
                installed = _distribution_version("sentence-transformers")
                raise AttributeError(f"{name} is not in the installed sentence-transformers {installed}", name=name)
            value = getattr(module, name)
            globals()[name] = value
            return value
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*globals(), *_public_names()})
