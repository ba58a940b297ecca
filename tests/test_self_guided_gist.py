"""Self-guided GIST (``guide=model``): the model's own detached embeddings decide the false negatives.

Cached and uncached give the gradients of a hand-written reference (plain torch ops, the definition of
GISTEmbed with the model's detached embeddings as guide), under every margin strategy, Matryoshka (whose
truncated embeddings guide themselves) and the layer-wise losses, with one embedding of each column.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from loss_checks import (
    assert_losses_agree,
    assert_same_grads,
    loss_and_grads,
    pair_dataset,
    text_columns,
)
from torch import nn

from st_ext import losses
from st_ext._compat import st_losses
from st_ext.training.frozen_encoders import apply_frozen_encoder_mode

upstream = st_losses()
pytestmark = pytest.mark.usefixtures("one_torch_thread")
BATCH = 8
DIMS = [32, 16, 8]
WEIGHTS = [1.0, 0.5, 0.25]
SETTINGS = [pytest.param(False, 3, id="eval-3-minibatches"), pytest.param(True, BATCH, id="dropout")]
COLUMNS = [pytest.param(2, id="pairs"), pytest.param(3, id="hard-negative")]
MARGINS = [
    pytest.param("absolute", 0.0, id="absolute-0"),
    pytest.param("absolute", -0.1, id="absolute-qwen3"),
    pytest.param("relative", 0.05, id="relative"),
    pytest.param("relative", -0.1, id="relative-negative"),
]
NOTHING_MASKED = dict(margin_strategy="absolute", margin=-10.0)  # every guide score stays below positive + 10


# ---------------------------------------------------------------------------------------------
# The hand-written reference


def self_gist_reference(
    embeddings: list[torch.Tensor],
    guide_embeddings: list[torch.Tensor],
    *,
    temperature: float = 0.01,
    margin_strategy: str = "absolute",
    margin: float = 0.0,
    contrast_anchors: bool = True,
    contrast_positives: bool = True,
) -> torch.Tensor:
    """GISTEmbed's loss over (anchor, positive, negative..) embeddings, masked by ``guide_embeddings``: a
    candidate the guide scores above the anchor's positive (less the margin) is dropped, never the positive."""
    unit = [F.normalize(column, dim=-1) for column in embeddings]
    guide = [F.normalize(column, dim=-1) for column in guide_embeddings]
    anchor, positive, *negatives = unit
    guide_anchor, guide_positive, *guide_negatives = guide
    rows = torch.arange(len(anchor))
    positive_score = (guide_anchor * guide_positive).sum(-1, keepdim=True)
    if margin_strategy == "absolute":
        limit = positive_score - margin
    else:
        limit = positive_score - positive_score.abs() * margin

    def block(left, right, guide_left, guide_right, own_positive=False):
        scores = left @ right.T
        dropped = guide_left @ guide_right.T > limit
        if own_positive:
            dropped[rows, rows] = False
        return scores.masked_fill(dropped, float("-inf"))

    blocks = [block(anchor, positive, guide_anchor, guide_positive, own_positive=True)]
    if contrast_anchors:
        blocks.append(block(anchor, anchor, guide_anchor, guide_anchor))
    if contrast_positives:
        blocks.append(block(positive, positive, guide_positive, guide_positive))
    blocks += [block(anchor, n, guide_anchor, g) for n, g in zip(negatives, guide_negatives)]
    return F.cross_entropy(torch.cat(blocks, dim=1) / temperature, rows)


class HandWrittenSelfGIST(nn.Module):
    """The model embeds each column once; the reference loss takes those embeddings, detached, as its guide.

    ``dims``: Matryoshka's (dimension, weight) pairs; ``guide_at_full_dim`` guides every dimension with the
    full embeddings instead of the truncated ones (the choice st_ext does not make)."""

    def __init__(self, model, dims=None, guide_at_full_dim: bool = False, **options) -> None:
        super().__init__()
        self.model = model
        self.dims = dims or [(None, 1.0)]
        self.guide_at_full_dim = guide_at_full_dim
        self.options = options

    def forward(self, sentence_features, labels):
        embeddings = [self.model(features)["sentence_embedding"] for features in sentence_features]
        total = 0.0
        for dim, weight in self.dims:
            truncated = [column[:, :dim] for column in embeddings]
            guide = embeddings if self.guide_at_full_dim else truncated
            total = total + weight * self_gist_reference(truncated, [g.detach() for g in guide], **self.options)
        return total


def the_three(model, mini_batch_size, **options):
    """Cached self-guided, uncached self-guided, and the hand-written reference."""
    return (
        losses.CachedGISTEmbedLoss(model, model, mini_batch_size=mini_batch_size, **options),
        losses.GISTEmbedLoss(model, model, **options),
        HandWrittenSelfGIST(model, **options),
    )


def assert_all_agree(model, loss_list, columns, *, train: bool):
    results = [loss_and_grads(model, loss, columns, train=train) for loss in loss_list]
    for result in results[1:]:
        assert_same_grads(result, results[0])
    return results[0]


# ---------------------------------------------------------------------------------------------
# Gradients


@pytest.mark.parametrize("train, mini_batch_size", SETTINGS)
@pytest.mark.parametrize("num_columns", COLUMNS)
@pytest.mark.parametrize("margin_strategy, margin", MARGINS)
def test_cached_and_uncached_equal_the_hand_written_loss(
    model, train, mini_batch_size, num_columns, margin_strategy, margin
):
    columns = text_columns(BATCH, num_columns)
    options = dict(temperature=0.05, margin_strategy=margin_strategy, margin=margin)
    result = assert_all_agree(model, the_three(model, mini_batch_size, **options), columns, train=train)
    # The guide dropped candidates: each one dropped takes its term out of a softmax denominator.
    unmasked = HandWrittenSelfGIST(model, temperature=0.05, **NOTHING_MASKED)
    assert result[0] < loss_and_grads(model, unmasked, columns, train=train)[0] - 1e-3


@pytest.mark.parametrize("anchors, positives", [(False, True), (True, False), (False, False)])
def test_contrast_options(model, anchors, positives):
    columns = text_columns(BATCH, 3)
    options = dict(margin=-0.05, contrast_anchors=anchors, contrast_positives=positives)
    assert_all_agree(model, the_three(model, 3, **options), columns, train=False)


# ---------------------------------------------------------------------------------------------
# One forward pass per column


def forward_calls(model) -> list[tuple[bool, int]]:
    """(with graph, rows) of every forward pass the model runs from now on."""
    calls = []
    model.register_forward_pre_hook(
        lambda module, args: calls.append((torch.is_grad_enabled(), len(args[0]["input_ids"])))
    )
    return calls


@pytest.mark.parametrize("num_columns", COLUMNS)
def test_the_model_embeds_each_column_once(model, num_columns):
    columns = text_columns(BATCH, num_columns)
    calls = forward_calls(model)
    loss_and_grads(model, losses.GISTEmbedLoss(model, model), columns, train=False)
    assert calls == [(True, BATCH)] * num_columns
    calls.clear()
    # Cached: every row once without a graph (GradCache's first pass), once with one (its replay), as without GIST.
    loss_and_grads(model, losses.CachedGISTEmbedLoss(model, model, mini_batch_size=3), columns, train=False)
    without_graph = sum(rows for graph, rows in calls if not graph)
    with_graph = sum(rows for graph, rows in calls if graph)
    assert without_graph == with_graph == BATCH * num_columns, calls


# ---------------------------------------------------------------------------------------------
# Matryoshka and the layer-wise losses


@pytest.mark.parametrize("train, mini_batch_size", SETTINGS)
@pytest.mark.parametrize("margin_strategy, margin", MARGINS[:2])
def test_matryoshka_guides_each_dimension_with_its_truncated_embeddings(
    model, train, mini_batch_size, margin_strategy, margin
):
    columns = text_columns(BATCH, 3)
    options = dict(temperature=0.05, margin_strategy=margin_strategy, margin=margin)
    cached, uncached, _ = the_three(model, mini_batch_size, **options)
    dims = list(zip(DIMS, WEIGHTS))
    assert_all_agree(
        model,
        [
            losses.MatryoshkaLoss(model, cached, DIMS, WEIGHTS),
            losses.MatryoshkaLoss(model, uncached, DIMS, WEIGHTS),
            HandWrittenSelfGIST(model, dims=dims, **options),
        ],
        columns,
        train=train,
    )


def test_matryoshka_does_not_guide_with_the_full_embeddings(model):
    """The premise of the test above: on its batch, a full-dimension guide masks other candidates."""
    columns = text_columns(BATCH, 3)
    dims = list(zip(DIMS, WEIGHTS))
    cached = losses.CachedGISTEmbedLoss(model, model, temperature=0.05, mini_batch_size=3)
    ours = loss_and_grads(model, losses.MatryoshkaLoss(model, cached, DIMS, WEIGHTS), columns, train=False)
    full_dim_guide = HandWrittenSelfGIST(model, dims=dims, guide_at_full_dim=True, temperature=0.05)
    full_dim_value = loss_and_grads(model, full_dim_guide, columns, train=False)[0]
    assert not torch.isclose(ours[0], full_dim_value, rtol=1e-2), (ours[0], full_dim_value)


LAYER_WISE = {
    # name: (st_ext's class, upstream's class, arguments after the loss)
    "adaptive": (losses.AdaptiveLayerLoss, upstream.AdaptiveLayerLoss, dict(n_layers_per_step=-1)),
    "matryoshka-2d": (losses.Matryoshka2dLoss, upstream.Matryoshka2dLoss, dict(matryoshka_dims=DIMS)),
}


@pytest.mark.parametrize("name", list(LAYER_WISE))
def test_layer_wise_losses_guide_each_layer_with_its_own_embeddings(model4, name):
    """st_ext's cached layer-wise loss equals upstream's wrapper over the uncached self-guided loss, which
    calls it with each layer's embeddings."""
    ours, theirs, arguments = LAYER_WISE[name]
    columns = text_columns(BATCH, 2)
    cached = ours(model4, losses.CachedGISTEmbedLoss(model4, model4, mini_batch_size=3, margin=-0.05), **arguments)
    reference = theirs(model4, losses.GISTEmbedLoss(model4, model4, margin=-0.05), **arguments)
    assert cached.uses_gradient_cache
    assert_losses_agree(model4, cached, reference, columns, train=False)


# ---------------------------------------------------------------------------------------------
# What a self-guided loss refuses, and how it shows


def test_cross_batch_memory_refuses_gist(model):
    """A queue of documents would need their guide's scores too; the memory refuses GIST in one line."""
    with pytest.raises(TypeError, match="CrossBatchMemoryLoss cannot wrap CachedGISTEmbedLoss"):
        losses.CrossBatchMemoryLoss(model, losses.CachedGISTEmbedLoss(model, model))


@pytest.mark.parametrize("loss_class", [losses.CachedGISTEmbedLoss, losses.GISTEmbedLoss])
def test_nothing_to_offload_precompute_or_look_up(model, loss_class):
    with pytest.raises(ValueError, match="guided by the model itself"):
        loss_class(model, model, offload_guide=True)
    table = losses.GuideEmbeddings({}, torch.empty(0, 32))
    with pytest.raises(ValueError, match="pass one or the other"):
        loss_class(model, model, guide_embeddings=table)
    loss = loss_class(model, model)
    dataset = pair_dataset(4)
    for mode in ("offload", "precompute"):
        with pytest.raises(ValueError, match="guided by the model itself"):
            apply_frozen_encoder_mode(mode, loss, train_dataset=dataset, show_progress_bar=False)
    assert loss.guide is model and all(p.requires_grad for p in model.parameters())


def test_a_wrapped_model_still_guides_itself(model):
    """The trainer swaps its DDP or DeepSpeed wrapper into ``loss.model`` only: the loss stays self-guided."""
    loss = losses.CachedGISTEmbedLoss(model, model, mini_batch_size=3)
    reference = loss_and_grads(model, loss, text_columns(BATCH, 2), train=False)
    calls = forward_calls(model)
    loss.model = Wrapper(model)
    assert_same_grads(loss_and_grads(model, loss, text_columns(BATCH, 2), train=False), reference)
    assert sum(rows for graph, rows in calls if not graph) == 2 * BATCH


class Wrapper(nn.Module):
    """Stands in for DDP: calls the model it wraps, which it holds as ``module``."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, features):
        return self.module(features)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


def test_a_separate_guide_is_unchanged(model, guide):
    """A guide that is not the model itself still runs its own pass (and a shallow copy sharing the model's
    weights is still refused as an offloaded guide)."""
    columns = text_columns(BATCH, 2)
    loss = losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=3)
    assert not loss.guides_itself
    assert_losses_agree(model, loss, upstream.GISTEmbedLoss(model, guide), columns, train=False)
    with pytest.raises(ValueError, match="shares its parameters"):
        losses.CachedGISTEmbedLoss(model, copy.copy(model), offload_guide=True)


def test_model_card_and_registry(model):
    loss = losses.CachedGISTEmbedLoss(model, model, margin=-0.1)
    assert loss.get_config_dict() == upstream.CachedGISTEmbedLoss(model, model, margin=-0.1).get_config_dict()
    assert loss.get_config_dict()["guide"] is model
    assert losses.build_loss("cached_gist", model, guide=model, mini_batch_size=3).guides_itself
    with pytest.raises(ValueError, match=r"needs a guide model, guide_embeddings, or the model itself .*guide=model"):
        losses.build_loss("cached_gist", model, mini_batch_size=3)
