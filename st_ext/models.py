"""``SentenceTransformer`` and ``CrossEncoder`` with complete checkpointing switches.

They are the upstream classes (same constructor, loading and saving: a saved model holds only
upstream module classes, so plain sentence-transformers loads it) plus :class:`CheckpointingMixin`,
which adds the methods upstream lacks in some part of the supported range:

* ``gradient_checkpointing_enable/disable`` and ``is_gradient_checkpointing`` (the names of
  transformers 4's Trainer; CrossEncoder had none before sentence-transformers 5.0, and no release
  has ``disable``),
* ``activation_checkpointing_enable/disable`` and ``is_activation_checkpointing`` (the names
  transformers 5's Trainer calls first),

all reaching every Hugging Face model in the tree (see :mod:`st_ext.checkpointing`).
"""

from __future__ import annotations

from typing import Any

import sentence_transformers

from st_ext import checkpointing


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
