"""Every upstream model archetype with complete checkpointing switches.

Each is the upstream class (same constructor, loading and saving: a saved model holds only upstream
module classes, so plain sentence-transformers loads it) plus :class:`CheckpointingMixin`, which adds
the switches upstream lacks somewhere in the supported range: transformers 4's
``gradient_checkpointing_*`` (CrossEncoder had none before sentence-transformers 5.0, and no release
has ``disable``) and transformers 5's ``activation_checkpointing_*``, all reaching every Hugging Face
model in the tree (:mod:`st_ext.checkpointing`).

``SentenceTransformer`` writes its model card with :class:`st_ext.model_card.SentenceTransformerModelCardData`
unless given card data, so that the card names st_ext's losses as the upstream losses they replace.

So that ``from st_ext.models import Transformer, Pooling`` works as upstream's ``models`` import, this module
also offers upstream's module classes (``sentence_transformers.models`` before 6.0,
``sentence_transformers.sentence_transformer.modules`` since), as upstream's own objects. Upstream's submodule
paths (``sentence_transformers.models.tokenizer``…) are imported from ``sentence_transformers``.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import sentence_transformers
from torch import nn

from st_ext import _compat, checkpointing, model_card

if TYPE_CHECKING:  # upstream's module classes as 6.x places them; at run time, the installed release's
    from sentence_transformers.sentence_transformer.modules import (
        CNN as CNN,
        LSTM as LSTM,
        Asym as Asym,
        BoW as BoW,
        CLIPModel as CLIPModel,
        Dense as Dense,
        Dropout as Dropout,
        InputModule as InputModule,
        LayerNorm as LayerNorm,
        Module as Module,
        Normalize as Normalize,
        Pooling as Pooling,
        Router as Router,
        StaticEmbedding as StaticEmbedding,
        Transformer as Transformer,
        WeightedLayerPooling as WeightedLayerPooling,
        WordEmbeddings as WordEmbeddings,
        WordWeights as WordWeights,
    )

_upstream_modules = _compat.st_modules()
#: Upstream's module classes of the installed release (its ``__all__``), offered here as upstream's objects.
UPSTREAM_MODULE_NAMES = [name for name in _upstream_modules.__all__ if not name.startswith("_")]
globals().update({name: getattr(_upstream_modules, name) for name in UPSTREAM_MODULE_NAMES})


class CheckpointingMixin(nn.Module):
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


_UPSTREAM_SENTENCE_TRANSFORMER_INIT = inspect.signature(sentence_transformers.SentenceTransformer.__init__)


class SentenceTransformer(CheckpointingMixin, sentence_transformers.SentenceTransformer):
    """Upstream ``SentenceTransformer`` with checkpointing over every module, whose model card names st_ext's
    losses as upstream's (see the module docstring)."""

    model_card_data_class = model_card.SentenceTransformerModelCardData

    if not TYPE_CHECKING:  # a type checker reads upstream's constructor, whose arguments this one binds

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            # 4.x's constructor makes its default card data by name; 6.x's reads model_card_data_class. Arguments
            # are bound as upstream binds them, so a positional model_card_data is seen too.
            bound = _UPSTREAM_SENTENCE_TRANSFORMER_INIT.bind(self, *args, **kwargs)
            if bound.arguments.get("model_card_data") is None:
                card_options = {"local_files_only": bound.arguments.get("local_files_only", False)}
                bound.arguments["model_card_data"] = self.model_card_data_class(
                    **_compat.accepted_kwargs(self.model_card_data_class, card_options)
                )
            super().__init__(*bound.args[1:], **bound.kwargs)

        __init__.__signature__ = _UPSTREAM_SENTENCE_TRANSFORMER_INIT


class CrossEncoder(CheckpointingMixin, sentence_transformers.CrossEncoder):
    """Upstream ``CrossEncoder`` with checkpointing over its classifier model, on every supported version."""

    if TYPE_CHECKING:  # 6.x's constructor, which upstream's decorator hides from a type checker

        def __init__(
            self,
            model_name_or_path: str | None = None,
            *,
            modules: list[nn.Module] | OrderedDict[str, nn.Module] | None = None,
            device: str | None = None,
            prompts: dict[str, str] | None = None,
            default_prompt_name: str | None = None,
            cache_folder: str | None = None,
            trust_remote_code: bool = False,
            revision: str | None = None,
            local_files_only: bool = False,
            token: bool | str | None = None,
            model_kwargs: dict | None = None,
            processor_kwargs: dict | None = None,
            config_kwargs: dict | None = None,
            model_card_data: sentence_transformers.CrossEncoderModelCardData | None = None,
            backend: Literal["torch", "onnx", "openvino"] = "torch",
            num_labels: int | None = None,
            max_length: int | None = None,
            activation_fn: Callable | None = None,
            keep_in_fp32_modules: list[str] | None = None,
        ) -> None: ...


if _compat.HAS_SPARSE_ENCODER:

    class SparseEncoder(CheckpointingMixin, sentence_transformers.SparseEncoder):
        """Upstream ``SparseEncoder`` (SPLADE, CSR…) with checkpointing over its MLM or encoder model."""


if _compat.HAS_MULTI_VECTOR_ENCODER:

    class MultiVectorEncoder(CheckpointingMixin, sentence_transformers.MultiVectorEncoder):
        """Upstream ``MultiVectorEncoder`` (ColBERT-style late interaction) with checkpointing over its encoder."""


if not TYPE_CHECKING:  # a type checker sees the archetypes the installed release has, and no other name

    def __getattr__(name: str):
        """Name the sentence-transformers release an archetype needs when the installed one lacks it."""
        error = _compat.missing_archetype_error(name) if name in _compat.ARCHETYPE_SINCE else None
        if error is not None:
            raise error
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
