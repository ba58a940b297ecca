"""Every upstream model archetype with complete checkpointing switches.

Each is the upstream class (same constructor, loading and saving: a saved model holds only upstream
module classes, so plain sentence-transformers loads it) plus :class:`CheckpointingMixin`, which adds
the switches upstream lacks somewhere in the supported range: transformers 4's
``gradient_checkpointing_*`` (CrossEncoder had none before sentence-transformers 5.0, and no release
has ``disable``) and transformers 5's ``activation_checkpointing_*``, all reaching every Hugging Face
model in the tree (:mod:`st_ext.checkpointing`).

This module also stands in for upstream's ``sentence_transformers.models`` (``Transformer``,
``Pooling``…): every other name reads through to upstream's namespace, and ``__path__`` lets its
submodule paths (``st_ext.models.tokenizer``…) import through :mod:`st_ext._upstream_aliases`.
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

    def activation_checkpointing_enable(
        self, activation_checkpointing_kwargs: dict | None = None, **kwargs: Any
    ) -> None:
        checkpointing.enable(self, activation_checkpointing_kwargs, **kwargs)

    def gradient_checkpointing_disable(self) -> None:
        checkpointing.disable(self)

    activation_checkpointing_disable = gradient_checkpointing_disable
    is_gradient_checkpointing = is_activation_checkpointing = property(checkpointing.is_enabled)


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
