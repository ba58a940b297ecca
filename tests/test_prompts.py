"""Prompts excluded from pooling: every loss and wrapper gives upstream's non-cached loss, whatever a module edits in place.

sentence-transformers 4.x's ``Pooling(include_prompt=False)`` zeroes the prompt positions of the
attention mask it is given, in place. Features get read more than once: a cached loss embeds every
row twice, a GIST loss embeds it with the model and with the guide, and upstream's Matryoshka and
layer-wise wrappers call a non-cached loss once per dimension or layer on the same features. Any of
those readers that shared memory with what the model was given would see the mask it zeroed.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from functools import partial

import pytest
import torch
from loss_checks import assert_same_grads, guide_from, loss_and_grads, text_columns

from st_ext import losses
from st_ext._compat import preprocess, st_losses, st_modules
from st_ext.models import SentenceTransformer

pytestmark = [pytest.mark.conformance, pytest.mark.usefixtures("one_torch_thread")]
upstream = st_losses()


def pooling_edits_callers_mask() -> bool:
    """Whether the installed ``Pooling(include_prompt=False)`` leaves the caller's features with the prompt
    positions of the attention mask zeroed (4.x and 5.3-5.6 zero the tensor, 5.7 puts a zeroed copy in
    the caller's dict; 6.0 keeps it to itself): asked of Pooling itself, not of its version."""
    pooling = st_modules().Pooling(4, pooling_mode="mean", include_prompt=False)
    mask = torch.ones(1, 3, dtype=torch.long)
    features = {"token_embeddings": torch.ones(1, 3, 4), "attention_mask": mask, "prompt_length": 1}
    pooling(features)
    return not (mask[0, 0] and features["attention_mask"][0, 0])


POOLING_EDITS_CALLERS_MASK = pooling_edits_callers_mask()
PROMPT = "query for the answer "
#: Five rows in mini-batches of two: some mini-batches hold the end of one column and the start of the next.
BATCH = 5
MINI_BATCH = 2
DIMS = [32, 8]


@pytest.fixture
def prompt_model(tiny_bert_dir):
    modules = st_modules()
    transformer = modules.Transformer(str(tiny_bert_dir), max_seq_length=32)
    pooling = modules.Pooling(transformer.auto_model.config.hidden_size, pooling_mode="mean", include_prompt=False)
    return SentenceTransformer(modules=[transformer, pooling], device="cpu")


@pytest.fixture(scope="module")
def prompt_guide(guide_dir):
    return guide_from(guide_dir)


def prompted_features(model, columns):
    """Each column tokenized with the prompt in front and its length recorded, as the trainer's collator does."""
    prompt_length = preprocess(model, [PROMPT])["input_ids"].shape[-1] - 1
    features = []
    for column in columns:
        column_features = preprocess(model, [PROMPT + text for text in column])
        column_features["prompt_length"] = torch.full((len(column),), prompt_length, dtype=torch.int)
        features.append(column_features)
    return features


#: One forward and backward of a loss on a prompted batch, dropout off, Python's and torch's RNG seeded
#: (so that layer-wise wrappers draw the same layers and dimensions for the loss and its reference).
step = partial(loss_and_grads, train=False, featurize=prompted_features)


@contextmanager
def prompt_excluded_from_a_copy(model):
    """Upstream's non-cached losses as 6.x runs them: every ``Pooling`` (the model's and a guide's) drops the
    prompt from a copy of the mask. 4.x and 5.x zero the caller's mask, which their losses then hand the
    next module (st_ext's guide sees the prompt, as 6.x's does: see the README's differences; 5.x's
    exclusion also zeroes the prompt again in an edited mask). Elsewhere a no-op."""
    if not POOLING_EDITS_CALLERS_MASK:
        yield
        return
    pooling_class = type(model[1])
    pool = pooling_class.forward

    def forward(self, features, *args, **kwargs):
        pooled = pool(self, {**features, "attention_mask": features["attention_mask"].clone()}, *args, **kwargs)
        features.update((key, value) for key, value in pooled.items() if key != "attention_mask")
        return features

    pooling_class.forward = forward
    try:
        yield
    finally:
        pooling_class.forward = pool


def reference_step(model, loss, columns, **kwargs):
    with prompt_excluded_from_a_copy(model):
        return step(model, loss, columns, **kwargs)


LOSSES = {
    # name: (st_ext's loss, upstream's non-cached reference, number of columns)
    "cached-mnrl": (
        lambda m, g: losses.CachedMultipleNegativesRankingLoss(m, mini_batch_size=MINI_BATCH),
        lambda m, g: upstream.MultipleNegativesRankingLoss(m),
        3,
    ),
    # Mini-batches of a whole column: 4.x's cached symmetric loss ranks the documents-to-query direction
    # within each mini-batch of anchors (and back-propagates every mini-batch's mean unweighted), so only
    # with one mini-batch of anchors is it the non-cached loss. GradCache still embeds in two passes.
    "cached-symmetric": (
        lambda m, g: losses.CachedMultipleNegativesSymmetricRankingLoss(m, mini_batch_size=BATCH),
        lambda m, g: upstream.MultipleNegativesSymmetricRankingLoss(m),
        2,
    ),
    "cached-gist": (
        lambda m, g: losses.CachedGISTEmbedLoss(m, g, mini_batch_size=MINI_BATCH),
        lambda m, g: upstream.GISTEmbedLoss(m, g),
        3,
    ),
    "gist": (lambda m, g: losses.GISTEmbedLoss(m, g), lambda m, g: upstream.GISTEmbedLoss(m, g), 3),
}
WRAPPERS = {
    # name: wrap(module, model, loss), with module st_ext's losses or upstream's. The tiny model has two
    # layers, so the layer-wise wrappers always train the single prior one; Matryoshka2dLoss draws one
    # dimension per layer from the seeded RNG, in upstream's order.
    "bare": lambda module, m, loss: loss,
    "matryoshka": lambda module, m, loss: module.MatryoshkaLoss(m, loss, DIMS),
    "matryoshka-2d": lambda module, m, loss: module.Matryoshka2dLoss(m, loss, DIMS),
    "adaptive-layer": lambda module, m, loss: module.AdaptiveLayerLoss(m, loss),
}


@pytest.mark.parametrize("wrapper, loss", list(itertools.product(WRAPPERS, LOSSES)))
def test_prompted_loss_equals_upstream_non_cached(prompt_model, prompt_guide, wrapper, loss):
    ours, reference, num_columns = LOSSES[loss]
    wrap = WRAPPERS[wrapper]
    columns = text_columns(BATCH, num_columns)
    expected = reference_step(
        prompt_model, wrap(upstream, prompt_model, reference(prompt_model, prompt_guide)), columns
    )
    actual = step(prompt_model, wrap(losses, prompt_model, ours(prompt_model, prompt_guide)), columns)
    assert_same_grads(actual, expected)


def test_prompted_cross_batch_memory_equals_non_cached(prompt_model):
    """The queue filled by one prompted batch, then a second batch against it: the cached ranking loss (the
    one cached loss the memory takes) gives the memory around upstream's non-cached one."""
    first, second = text_columns(BATCH, 2, seed=1), text_columns(BATCH, 2, seed=2)
    results = []
    for run, inner in [
        (step, losses.CachedMultipleNegativesRankingLoss(prompt_model, mini_batch_size=MINI_BATCH)),
        (reference_step, upstream.MultipleNegativesRankingLoss(prompt_model)),
    ]:
        memory = losses.CrossBatchMemoryLoss(prompt_model, inner, memory_size=4 * BATCH)
        run(prompt_model, memory, first)
        results.append(run(prompt_model, memory, second))
    assert_same_grads(*results)


def test_cached_matryoshka_over_upstreams_cached_loss(prompt_model):
    columns = text_columns(BATCH, 3)
    cached = losses.MatryoshkaLoss(
        prompt_model, upstream.CachedMultipleNegativesRankingLoss(prompt_model, mini_batch_size=MINI_BATCH), DIMS
    )
    reference = upstream.MatryoshkaLoss(prompt_model, upstream.MultipleNegativesRankingLoss(prompt_model), DIMS)
    assert_same_grads(step(prompt_model, cached, columns), reference_step(prompt_model, reference, columns))


def test_upstreams_4x_guide_loses_the_prompt(prompt_model, prompt_guide):
    """Upstream's 4.x GIST losses run the guide on the dict the model's Pooling already edited, so their
    guide drops the prompt too; from 5.x on upstream's loss is the reference as it stands."""
    columns = text_columns(BATCH, 2)
    loss = upstream.GISTEmbedLoss(prompt_model, prompt_guide)
    as_released = step(prompt_model, loss, columns)
    if POOLING_EDITS_CALLERS_MASK:
        assert not torch.isclose(as_released[0], reference_step(prompt_model, loss, columns)[0], rtol=1e-4)
    else:
        assert_same_grads(as_released, reference_step(prompt_model, loss, columns))


def test_the_prompt_changes_the_loss(prompt_model, prompt_guide):
    """Without this the tests above would pass on a model that ignores the prompt setting."""
    columns = text_columns(BATCH, 2)
    loss = losses.GISTEmbedLoss(prompt_model, prompt_guide)
    with_prompt, _ = step(prompt_model, loss, columns)
    prompt_model[1].include_prompt = True
    without_exclusion, _ = step(prompt_model, loss, columns)
    assert not torch.isclose(with_prompt, without_exclusion, rtol=1e-4)


def test_a_distillation_teacher_reads_the_collators_rows_at_every_call(prompt_model, prompt_guide):
    """A wrapper calls a non-cached loss once per dimension or layer on the same features: the teacher
    must label the rows the collator made every time, not the mask the model's Pooling edited."""
    loss = losses.DistillationLoss(upstream.MSELoss(prompt_model), prompt_guide)
    features = prompted_features(prompt_model, text_columns(BATCH, 1))
    prompt_model.eval()
    with torch.no_grad():
        first, second = loss(features, None), loss(features, None)
    torch.testing.assert_close(first, second)
