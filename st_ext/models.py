"""Every upstream model archetype with complete checkpointing switches.

``SentenceTransformer`` and ``CrossEncoder`` on every supported release, ``SparseEncoder`` from
sentence-transformers 5.0 and ``MultiVectorEncoder`` from 6.0 (on older releases importing them
raises an ImportError naming the release they need). Each is the upstream class (same constructor,
loading and saving: a saved model holds only upstream module classes, so plain sentence-transformers
loads it) plus :class:`CheckpointingMixin`, which adds the methods upstream lacks in some part of the
supported range:

* ``gradient_checkpointing_enable/disable`` and ``is_gradient_checkpointing`` (the names of
  transformers 4's Trainer; CrossEncoder had none before sentence-transformers 5.0, and no release
  has ``disable``),
* ``activation_checkpointing_enable/disable`` and ``is_activation_checkpointing`` (the names
  transformers 5's Trainer calls first),

all reaching every Hugging Face model in the tree (see :mod:`st_ext.checkpointing`), by the names
the installed transformers prefers (never its deprecated ones).

This module also stands in for upstream's ``sentence_transformers.models`` (the modules ``Transformer``,
``Pooling``, ``Dense``…; on 6.x a deprecated path to ``sentence_transformers.sentence_transformer.modules``),
so that ``from st_ext.models import Transformer, Pooling`` works as upstream's import does: every other
name reads through to upstream's namespace, and ``__path__`` lets its submodule paths
(``st_ext.models.tokenizer``…) import through :mod:`st_ext._upstream_aliases`.
"""

from __future__ import annotations

from typing import Any

import sentence_transformers

from st_ext import _compat, _upstream_aliases, checkpointing

#: No files of its own: upstream's submodule paths below ``models`` are found by st_ext's alias finder.
__path__: list[str] = []


class CheckpointingMixin:
    """Checkpointing switches for any ``nn.Module`` container; put it first among the bases."""

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None, **kwargs: Any) -> None:
        checkpointing.enable(self, gradient_checkpointing_kwargs, **kwargs)

    def gradient_checkpointing_disable(self) -> None:
        checkpointing.disable(self)

    @property
    def is_gradient_checkpointing(self) -> bool:
        return checkpointing.is_enabled(self)

    def activation_checkpointing_enable(
        self, activation_checkpointing_kwargs: dict | None = None, **kwargs: Any
    ) -> None:
        checkpointing.enable(self, activation_checkpointing_kwargs, **kwargs)

    def activation_checkpointing_disable(self) -> None:
        checkpointing.disable(self)

    @property
    def is_activation_checkpointing(self) -> bool:
        return checkpointing.is_enabled(self)


class SentenceTransformer(CheckpointingMixin, sentence_transformers.SentenceTransformer):
    """Upstream ``SentenceTransformer`` with checkpointing over every module (see the module docstring)."""


class CrossEncoder(CheckpointingMixin, sentence_transformers.CrossEncoder):
    """Upstream ``CrossEncoder`` with checkpointing over its classifier model, on every supported version."""


if _compat.HAS_SPARSE_ENCODER:

    class SparseEncoder(CheckpointingMixin, sentence_transformers.SparseEncoder):
        """Upstream ``SparseEncoder`` (SPLADE, CSR…) with checkpointing over its MLM or encoder model."""


if _compat.HAS_MULTI_VECTOR_ENCODER:

    class MultiVectorEncoder(CheckpointingMixin, sentence_transformers.MultiVectorEncoder):
        """Upstream ``MultiVectorEncoder`` (ColBERT-style late interaction) with checkpointing over its encoder."""


def __getattr__(name: str):
    """Upstream's ``models`` names (``Transformer``, ``Pooling``…); name the sentence-transformers release
    an archetype needs when the installed one lacks it."""
    error = _compat.missing_archetype_error(name) if name in _compat.ARCHETYPE_SINCE else None
    if error is not None:
        raise error
    if not name.startswith("_"):
        value = _upstream_aliases.resolve(__name__, _compat.st_modules(), name)
        if value is not _upstream_aliases.MISSING:
            return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *(name for name in dir(_compat.st_modules()) if not name.startswith("_"))})
