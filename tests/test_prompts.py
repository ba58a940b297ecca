"""Prompts excluded from pooling: cached losses give the non-cached loss, whatever a module edits in place.

sentence-transformers 4.x's ``Pooling(include_prompt=False)`` zeroes the prompt positions of the
attention mask it is given, in place. A cached loss embeds every row twice; if its mini-batches shared
memory with the batch, the second pass would see the mask the first pass zeroed and attend differently.
"""

from __future__ import annotations

import pytest
import torch

from st_ext import losses
from st_ext._compat import preprocess, st_losses, st_modules
from st_ext.models import SentenceTransformer
from loss_checks import assert_same_grads, guide_from, text_columns

upstream = st_losses()
#: 4.x's Pooling zeroes the prompt positions of the caller's attention mask; later releases copy it first.
POOLING_EDITS_MASK_IN_PLACE = not hasattr(st_modules().Pooling, "_exclude_prompt_from_mask")
PROMPT = "query for the answer "
BATCH = 6


@pytest.fixture
def prompt_model(tiny_bert_dir):
    modules = st_modules()
    transformer = modules.Transformer(str(tiny_bert_dir), max_seq_length=32)
    pooling = modules.Pooling(transformer.auto_model.config.hidden_size, pooling_mode="mean", include_prompt=False)
    return SentenceTransformer(modules=[transformer, pooling], device="cpu")


def prompted_features(model, columns):
    """Each column tokenized with the prompt in front and its length recorded, as the trainer's collator does."""
    prompt_length = preprocess(model, [PROMPT])["input_ids"].shape[-1] - 1
    features = []
    for column in columns:
        column_features = preprocess(model, [PROMPT + text for text in column])
        column_features["prompt_length"] = torch.full((len(column),), prompt_length, dtype=torch.int)
        features.append(column_features)
    return features


def step(model, loss, columns):
    model.zero_grad(set_to_none=True)
    model.eval()
    value = loss(prompted_features(model, columns), None)
    value.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return value.detach(), grads


@pytest.mark.parametrize("mini_batch_size", [1, 4])
def test_cached_gist_with_prompt_equals_gist(prompt_model, guide_dir, mini_batch_size):
    """The guide embeds the prompted rows as given. Upstream's 4.x GIST losses run the guide on the dict
    the model's Pooling already edited, so there its guide also drops the prompt (see the README's
    differences); from 5.x on upstream's non-cached loss is the reference itself."""
    columns = text_columns(BATCH, 2)
    guide = guide_from(guide_dir)
    cached = losses.CachedGISTEmbedLoss(prompt_model, guide, mini_batch_size=mini_batch_size)
    expected = step(prompt_model, losses.GISTEmbedLoss(prompt_model, guide), columns)
    assert_same_grads(step(prompt_model, cached, columns), expected)
    if POOLING_EDITS_MASK_IN_PLACE:
        leaky = step(prompt_model, upstream.GISTEmbedLoss(prompt_model, guide), columns)
        assert not torch.isclose(leaky[0], expected[0], rtol=1e-4)
    else:
        assert_same_grads(step(prompt_model, upstream.GISTEmbedLoss(prompt_model, guide), columns), expected)


def test_cached_matryoshka_with_prompt_equals_non_cached(prompt_model):
    columns = text_columns(BATCH, 3)
    dims = [32, 8]
    cached = losses.MatryoshkaLoss(
        prompt_model, upstream.CachedMultipleNegativesRankingLoss(prompt_model, mini_batch_size=2), dims
    )
    reference = upstream.MatryoshkaLoss(prompt_model, upstream.MultipleNegativesRankingLoss(prompt_model), dims)
    assert_same_grads(step(prompt_model, cached, columns), step(prompt_model, reference, columns))


def test_the_prompt_changes_the_loss(prompt_model, guide_dir):
    """Without this the tests above would pass on a model that ignores the prompt setting."""
    columns = text_columns(BATCH, 2)
    loss = upstream.GISTEmbedLoss(prompt_model, guide_from(guide_dir))
    with_prompt, _ = step(prompt_model, loss, columns)
    prompt_model[1].include_prompt = True
    without_exclusion, _ = step(prompt_model, loss, columns)
    assert not torch.isclose(with_prompt, without_exclusion, rtol=1e-4)
