"""Models whose inputs cannot be split into mini-batches are refused by st_ext's own check, with a way out."""

from __future__ import annotations

import pytest
from tiny_models import build_tokenizer, sentence_transformer_from
from torch import nn

from st_ext import SentenceTransformer, losses
from st_ext._compat import st_modules
from st_ext.losses.gradcache import embeds_with_static_embedding


def static_embedding():
    return st_modules().StaticEmbedding(build_tokenizer().backend_tokenizer, embedding_dim=32)


def routed(query: nn.Module, document: nn.Module) -> nn.Module:
    """A Router (5.x+) or, before it existed, an Asym with one route per side."""
    modules = st_modules()
    router = getattr(modules, "Router", None) or modules.Asym
    return router({"query": [query], "document": [document]})


def test_static_embedding_directly_or_behind_a_router(tiny_bert_dir, guide):
    transformer = sentence_transformer_from(tiny_bert_dir)[0]
    direct = SentenceTransformer(modules=[static_embedding()], device="cpu")
    behind_router = SentenceTransformer(modules=[routed(static_embedding(), transformer)], device="cpu")
    assert embeds_with_static_embedding(direct) and embeds_with_static_embedding(behind_router)
    assert not embeds_with_static_embedding(sentence_transformer_from(tiny_bert_dir))
    for model in (direct, behind_router):
        with pytest.raises(ValueError, match="StaticEmbedding.*GISTEmbedLoss instead"):
            losses.CachedGISTEmbedLoss(model, guide)
