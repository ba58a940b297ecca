"""Every documented combination of wrapper × cross-batch memory × inner loss × option trains right, or is refused.

Each supported combination trains three steps on three kinds of data (distinct rows; a positive repeated within
the batch and a repeated row; rows that come back in the next step) cached at a mini-batch of 4 and in one pass,
and the two agree at every step (value and every gradient: the queue, the masks and the draws are the same
whatever the mini-batch). Where upstream has the same computation without caching (distinct rows, an empty queue
at the first step), the first step's gradients equal upstream's. Every other combination is refused when the
loss is built, in one line that names the class and the option. docs/composition.md holds the table.
"""

from __future__ import annotations

import inspect
import itertools
import random
from dataclasses import dataclass

import pytest
import torch
from loss_checks import assert_same_grads, features_of, random_texts

from st_ext import losses
from st_ext._compat import st_losses, trainer_sums_loss_terms

upstream = st_losses()
BATCH = 6
STEPS = 3
#: Rows per mini-batch of the cached runs: a step of 12 texts in three or more forward passes.
MINI_BATCH = 4
DIMS = [32, 16]
#: Whether the installed MultipleNegativesRankingLoss scores other directions than query to document (not 4.x).
HAS_DIRECTIONS = "directions" in inspect.signature(upstream.MultipleNegativesRankingLoss).parameters


# --- data: (columns, labels) per step ------------------------------------------------------------------------


def ranking_batches(shape: str) -> list[tuple[list[list[str]], torch.Tensor]]:
    """Three (anchor, positive) batches and each row's document id (a row's positive's)."""
    texts = random_texts(2 * BATCH * STEPS, seed=7)
    batches = []
    for step in range(STEPS):
        anchors = texts[2 * BATCH * step : 2 * BATCH * step + BATCH]
        positives = texts[2 * BATCH * step + BATCH : 2 * BATCH * (step + 1)]
        ids = list(range(100 * step, 100 * step + BATCH))
        if shape == "repeated":
            positives[1], ids[1] = positives[0], ids[0]  # another query of the same passage
            anchors[3], positives[3], ids[3] = anchors[2], positives[2], ids[2]  # the same row twice
        if shape == "returning" and step:
            previous_anchors, previous_positives, previous_ids = batches[-1][0][0], batches[-1][0][1], batches[-1][1]
            anchors[:3], positives[:3] = previous_anchors[:3], previous_positives[:3]
            ids[:3] = previous_ids[:3].tolist()
        batches.append(([anchors, positives], torch.tensor(ids)))
    return batches


def labelled_batches(shape: str) -> list[tuple[list[list[str]], torch.Tensor]]:
    """Three (text, class label) batches, two texts per class."""
    texts = random_texts(BATCH * STEPS, seed=9)
    batches = []
    for step in range(STEPS):
        rows = texts[BATCH * step : BATCH * (step + 1)]
        labels = torch.tensor([3 * step + row // 2 for row in range(BATCH)])
        if shape == "returning" and step:
            rows[:2], labels[:2] = batches[-1][0][0][:2], batches[-1][1][:2]
        batches.append(([rows], labels))
    return batches


# --- the combinations -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Combination:
    inner: str
    memory: bool
    wrapper: str
    option: str

    @property
    def id(self) -> str:
        return "-".join([self.wrapper, "memory" if self.memory else "plain", self.inner, self.option])

    @property
    def labelled(self) -> bool:
        return self.inner == "triplet"


INNERS = ("cached_mnrl", "mnrl", "cached_symmetric", "self_guided_gist", "triplet")
WRAPPERS = ("none", "matryoshka", "adaptive_one_layer", "adaptive_every_layer", "matryoshka_2d")
OPTIONS = ("plain", "document_ids", "text_ids", "directions", "query_bank", "kept_graphs", "auto", "embedding_losses")
#: The options that mask by document, and the document_ids each gives.
DOCUMENT_IDS = {"document_ids": "label", "text_ids": "text"}
CACHED_INNERS = ("cached_mnrl", "cached_symmetric", "self_guided_gist")


def applies(combination: Combination) -> bool:
    """Whether the option is one this inner loss and memory take at all (others are not combinations)."""
    inner, option = combination.inner, combination.option
    if not combination.memory and inner in ("mnrl", "triplet"):
        return False  # upstream's own losses, nothing of st_ext's
    if inner == "cached_symmetric" and not HAS_DIRECTIONS:
        return False  # 4.x's cached symmetric loss averages per mini-batch: its value is the mini-batch size's
    if option in ("kept_graphs", "auto"):
        return inner in CACHED_INNERS
    if option == "embedding_losses":  # GOR added to the pass of a loss the engine caches (a memory's too)
        return inner in CACHED_INNERS or combination.memory
    if option == "query_bank":
        return combination.memory
    if option == "directions":
        return inner in ("cached_mnrl", "mnrl") and HAS_DIRECTIONS
    return True


def expected_refusal(combination: Combination) -> tuple[type[Exception], str] | None:
    """The one-line error a combination the docs do not support raises when built: (type, words it holds)."""
    if combination.memory and combination.inner == "self_guided_gist":
        return TypeError, "CrossBatchMemoryLoss cannot wrap CachedGISTEmbedLoss"
    if combination.inner == "cached_symmetric" and combination.option in DOCUMENT_IDS:
        return (
            TypeError,
            "CachedMultipleNegativesSymmetricRankingLoss: got an unexpected keyword argument 'document_ids'",
        )
    if combination.memory and combination.inner == "cached_symmetric":
        return TypeError, "CrossBatchMemoryLoss cannot wrap CachedMultipleNegativesSymmetricRankingLoss"
    if combination.inner == "triplet" and combination.option in (*DOCUMENT_IDS, "query_bank"):
        return ValueError, "query_bank and document_ids apply to ranking losses"
    if combination.option == "query_bank" and not HAS_DIRECTIONS:
        return ValueError, "query_bank=True needs the directions option"
    if combination.option == "embedding_losses" and not trainer_sums_loss_terms():
        return RuntimeError, "EmbeddingLossSum returns its terms by name"
    return None


def build(combination: Combination, model, mini_batch_size: int | None) -> torch.nn.Module:
    """The combination over ``model``; ``mini_batch_size`` None: one pass (a mini-batch larger than any batch)."""
    option = combination.option
    size = 10 * BATCH if mini_batch_size is None else mini_batch_size
    cached_options = {}
    if option == "kept_graphs" and mini_batch_size is not None:
        cached_options = {"kept_graphs": 1}
    if option == "auto" and mini_batch_size is not None:
        size, cached_options = "auto", {"memory_budget_mb": 4096}
    ranking_options = (
        {"directions": ("query_to_doc", "query_to_query", "doc_to_query")} if option == "directions" else {}
    )
    if option == "query_bank" and HAS_DIRECTIONS:
        ranking_options = {"directions": ("query_to_doc", "query_to_query")}
    document_ids = {"document_ids": DOCUMENT_IDS[option]} if option in DOCUMENT_IDS else {}
    if combination.inner == "cached_mnrl":
        inner = losses.CachedMultipleNegativesRankingLoss(
            model, mini_batch_size=size, **cached_options, **ranking_options, **document_ids
        )
        document_ids = {}
    elif combination.inner == "cached_symmetric":
        inner = losses.CachedMultipleNegativesSymmetricRankingLoss(
            model, mini_batch_size=size, **cached_options, **document_ids
        )
        document_ids = {}
    elif combination.inner == "self_guided_gist":
        inner = losses.CachedGISTEmbedLoss(model, model, mini_batch_size=size, **cached_options, **document_ids)
        document_ids = {}
    elif combination.inner == "mnrl":
        inner = upstream.MultipleNegativesRankingLoss(model, **ranking_options)
    else:
        inner = losses.BatchAllTripletLoss(model)
    if combination.memory:
        inner = losses.CrossBatchMemoryLoss(
            model, inner, memory_size=64, query_bank=option == "query_bank", **document_ids
        )
    if option == "embedding_losses":  # 4.x has no GOR, and refuses the sum before reading what it adds
        gor = getattr(upstream, "GlobalOrthogonalRegularizationLoss", None)
        inner = losses.EmbeddingLossSum(inner, {"gor": gor(model) if gor else torch.nn.Identity()})
    return wrap(combination.wrapper, model, inner, losses)


def wrap(wrapper: str, model, inner, namespace) -> torch.nn.Module:
    if wrapper == "none":
        return inner
    if wrapper == "matryoshka":
        return namespace.MatryoshkaLoss(model, inner, DIMS)
    if wrapper == "adaptive_one_layer":
        return namespace.AdaptiveLayerLoss(model, inner, n_layers_per_step=1)
    if wrapper == "adaptive_every_layer":
        return namespace.AdaptiveLayerLoss(model, inner, n_layers_per_step=-1)
    return namespace.Matryoshka2dLoss(model, inner, DIMS, n_layers_per_step=1)


def upstream_reference(combination: Combination, model) -> torch.nn.Module | None:
    """Upstream's uncached loss of the same computation at the first step (an empty queue), or None."""
    option = combination.option
    if combination.inner == "self_guided_gist" or option in ("query_bank", "embedding_losses"):
        return None  # the sum's reference is upstream's recipe, in test_embedding_loss_sum.py
    if combination.inner == "triplet":
        inner = upstream.BatchAllTripletLoss(model)
    elif combination.inner == "cached_symmetric":
        inner = upstream.MultipleNegativesSymmetricRankingLoss(model)
    else:
        directions = (
            {"directions": ("query_to_doc", "query_to_query", "doc_to_query")} if option == "directions" else {}
        )
        inner = upstream.MultipleNegativesRankingLoss(model, **directions)
    return wrap(combination.wrapper, model, inner, upstream)


def combinations() -> list[Combination]:
    every = [Combination(*values) for values in itertools.product(INNERS, (False, True), WRAPPERS, OPTIONS)]
    return [combination for combination in every if applies(combination)]


SUPPORTED = [c for c in combinations() if expected_refusal(c) is None]
REFUSED = [c for c in combinations() if expected_refusal(c) is not None]


# --- running ----------------------------------------------------------------------------------------------------


def train_steps(model, loss, batches) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Each step's value and gradients, from the same RNG state (dropout off: the layers and dimensions drawn
    are the same in every run)."""
    model.eval()
    results = []
    for step, (columns, labels) in enumerate(batches):
        model.zero_grad(set_to_none=True)
        features = features_of(model, columns)
        random.seed(step)
        torch.manual_seed(step)
        value = loss(features, labels)
        if isinstance(value, dict):  # a loss of named terms (EmbeddingLossSum): the trainers sum them
            value = sum(value.values())
        value.backward()
        grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
        results.append((value.detach(), grads))
    model.zero_grad(set_to_none=True)
    return results


SHAPES = ("distinct", "repeated", "returning")


def shapes_of(combination: Combination) -> tuple[str, ...]:
    """A memory meets all three; without one a batch does not depend on the one before it, and only
    masking by document treats a repeated positive differently from a distinct one."""
    if combination.labelled:
        return ("distinct", "returning")
    if combination.memory:
        return SHAPES
    return ("distinct", "repeated") if combination.option in DOCUMENT_IDS else ("distinct",)


@pytest.mark.parametrize(
    ("combination", "shape"),
    [pytest.param(c, shape, id=f"{c.id}-{shape}") for c in SUPPORTED for shape in shapes_of(c)],
)
def test_a_supported_combination_trains_as_its_reference(model4, combination, shape):
    batches = (labelled_batches if combination.labelled else ranking_batches)(shape)
    if not combination.memory:
        batches = batches[:2]  # nothing carries over from one step to the next
    cached = train_steps(model4, build(combination, model4, MINI_BATCH), batches)
    one_pass = train_steps(model4, build(combination, model4, None), batches)
    for step, (actual, expected) in enumerate(zip(cached, one_pass)):
        assert torch.isfinite(actual[0]), f"step {step}"
        assert_same_grads(actual, expected)
    reference = upstream_reference(combination, model4)
    if reference is not None and shape == "distinct":
        assert_same_grads(cached[0], train_steps(model4, reference, batches[:1])[0])


@pytest.mark.parametrize("combination", [pytest.param(c, id=c.id) for c in REFUSED])
def test_an_unsupported_combination_is_refused_when_built(model4, combination):
    error_type, words = expected_refusal(combination)
    with pytest.raises(error_type) as refused:
        build(combination, model4, MINI_BATCH)
    message = str(refused.value)
    assert words in message and "\n" not in message
