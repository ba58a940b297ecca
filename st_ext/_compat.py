"""The one place that knows which upstream versions are installed and how they differ.

Supported: sentence-transformers 4.1.0 … 6.2.0 on transformers 4.51 … 5.x. Everything else in
st_ext asks this module instead of comparing versions itself. The differences that matter:

* sentence-transformers 5.4 made ``CrossEncoder`` a modular ``nn.Sequential``; before, it was an
  ``nn.Module`` holding the Hugging Face classifier in ``.model``.
* sentence-transformers 6.0 moved ``sentence_transformers.models`` to
  ``sentence_transformers.sentence_transformer.modules`` (the old path warns).
* transformers 5 renamed ``gradient_checkpointing_enable/disable`` to
  ``activation_checkpointing_enable/disable`` (the old names warn) and defaults ``use_reentrant``
  to False; transformers 4 only has the old names and defaults ``use_reentrant`` to True.
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType
from typing import Any

import sentence_transformers
import transformers
from packaging.version import Version
from torch import nn

ST_VERSION = Version(sentence_transformers.__version__)
TRANSFORMERS_VERSION = Version(transformers.__version__)

MIN_ST_VERSION = Version("4.1.0")
MAX_ST_VERSION = Version("6.2.0")

#: Upstream ``CrossEncoder`` has ``gradient_checkpointing_enable`` (added in 5.0.0, upstream PR #3331).
CROSS_ENCODER_HAS_CHECKPOINTING = ST_VERSION >= Version("5.0.0")

#: ``CrossEncoder`` is an ``nn.Sequential`` of modules (5.4+) rather than a wrapper of ``.model``.
CROSS_ENCODER_IS_MODULAR = ST_VERSION >= Version("5.4.0")

#: transformers' own name for the checkpointing switch (transformers 5 deprecates the old one).
HF_HAS_ACTIVATION_CHECKPOINTING = hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable")


def st_modules() -> ModuleType:
    """The module namespace holding ``Transformer``, ``Pooling``, ``StaticEmbedding``, ``Asym``…"""
    if ST_VERSION >= Version("6.0.0"):
        return importlib.import_module("sentence_transformers.sentence_transformer.modules")
    return importlib.import_module("sentence_transformers.models")


def st_losses() -> ModuleType:
    """The upstream ``losses`` namespace for SentenceTransformer models."""
    return importlib.import_module("sentence_transformers.losses")


def preprocess(model: nn.Module, texts: list) -> dict:
    """Tokenize ``texts`` for ``model`` (``tokenize`` was renamed ``preprocess`` in 5.4)."""
    method = getattr(model, "preprocess", None) or model.tokenize
    return method(texts)


def embedding_dimension(model: nn.Module) -> int | None:
    """The model's output embedding size (``get_sentence_embedding_dimension`` was renamed in 6.0)."""
    method = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
    return method()


def checkpointing_training_args(enabled: bool) -> dict[str, bool]:
    """The TrainingArguments keyword that switches checkpointing (transformers 5 renamed it)."""
    if HF_HAS_ACTIVATION_CHECKPOINTING:
        return {"activation_checkpointing": enabled}
    return {"gradient_checkpointing": enabled}


def hf_checkpointing_enable(model: transformers.PreTrainedModel, checkpoint_kwargs: dict, **extra: Any) -> None:
    """Switch checkpointing on in a Hugging Face model by the name its transformers version prefers.

    ``extra`` (transformers 5's ``every_n_layers``, ``offload``) is passed only where accepted.
    """
    if HF_HAS_ACTIVATION_CHECKPOINTING:
        method = model.activation_checkpointing_enable
        method(activation_checkpointing_kwargs=checkpoint_kwargs, **accepted_kwargs(method, extra))
    else:
        method = model.gradient_checkpointing_enable
        method(gradient_checkpointing_kwargs=checkpoint_kwargs, **accepted_kwargs(method, extra))


def hf_checkpointing_disable(model: transformers.PreTrainedModel) -> None:
    if HF_HAS_ACTIVATION_CHECKPOINTING:
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def accepted_kwargs(function, kwargs: dict) -> dict:
    """The subset of ``kwargs`` that ``function`` accepts by name (all of them if it takes ``**kwargs``)."""
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return dict(kwargs)
    names = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {key: value for key, value in kwargs.items() if key in names}


def is_hf_model(module: nn.Module) -> bool:
    return isinstance(module, transformers.PreTrainedModel)
