"""Same-document masking (``document_ids``): a candidate from an anchor's own document is not its negative,
in st_ext's CachedMultipleNegativesRankingLoss, (Cached)GISTEmbedLoss and CrossBatchMemoryLoss (batch and
queue); and a row's own positive, repeated in the batch or queued from an earlier step (6.2's duplicate-free
sampler refills batches with earlier rows), is never its negative. References are written by hand
(tests/ranking_reference.py); the two-rank checks are in tests/test_distributed.py."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from loss_checks import assert_same_grads, features_of, loss_and_grads, random_texts, text_columns
from packaging.version import Version
from ranking_reference import ranking_loss_by_hand

from st_ext._compat import ST_VERSION, st_losses
from st_ext.losses import CachedGISTEmbedLoss, CachedMultipleNegativesRankingLoss, GISTEmbedLoss, MatryoshkaLoss
from st_ext.losses.cross_batch_memory import CrossBatchMemoryLoss
from st_ext.losses.memory_bank import document_keys

upstream = st_losses()
BATCH = 6
#: Rows 0 and 3 share a document, rows 1 and 5 another; -1: a row of no known document.
DOCUMENTS = torch.tensor([7, 2, 9, 7, -1, 2])

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def with_labels(loss, labels):
    return lambda features, _: loss(features, labels)


def by_hand(model, anchor_ids, **kwargs):
    def loss(features, _labels):
        anchors, *documents = [model(f)["sentence_embedding"] for f in features]
        unknown = torch.full_like(anchor_ids, -1)
        ids = torch.cat([anchor_ids] + [unknown] * (len(documents) - 1) + [kwargs.pop("queued_ids", anchor_ids[:0])])
        return ranking_loss_by_hand(anchors, documents, anchor_ids=anchor_ids, document_ids=ids, **kwargs)

    return loss


@pytest.mark.parametrize("num_columns", [2, 3])
def test_cached_ranking_loss_masks_candidates_of_the_anchors_document(model, num_columns):
    columns = text_columns(BATCH, num_columns)
    loss = CachedMultipleNegativesRankingLoss(model, mini_batch_size=2, document_ids="label")
    expected = loss_and_grads(model, by_hand(model, DOCUMENTS), columns, train=False)
    assert_same_grads(loss_and_grads(model, with_labels(loss, DOCUMENTS), columns, train=False), expected)
    plain = upstream.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2)
    assert not torch.isclose(loss_and_grads(model, plain, columns, train=False)[0], expected[0])


def test_distinct_documents_give_upstreams_loss(model):
    columns = text_columns(BATCH, 3)
    loss = CachedMultipleNegativesRankingLoss(model, mini_batch_size=2, document_ids="label")
    plain = upstream.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2)
    assert_same_grads(
        loss_and_grads(model, with_labels(loss, torch.arange(BATCH)), columns, train=False),
        loss_and_grads(model, plain, columns, train=False),
    )


def test_a_function_gives_the_ids_and_matryoshka_truncates_the_masked_loss(model):
    dims = [32, 16]
    seen = []

    def ids_of(sentence_features, labels):
        seen.append(labels)
        return DOCUMENTS

    loss = MatryoshkaLoss(
        model, CachedMultipleNegativesRankingLoss(model, mini_batch_size=4, document_ids=ids_of), dims
    )

    def reference(features, _labels):
        anchors, positives = [model(f)["sentence_embedding"] for f in features]
        return sum(
            ranking_loss_by_hand(anchors[:, :dim], [positives[:, :dim]], anchor_ids=DOCUMENTS, document_ids=DOCUMENTS)
            for dim in dims
        )

    columns = text_columns(BATCH, 2)
    assert_same_grads(
        loss_and_grads(model, loss, columns, train=False), loss_and_grads(model, reference, columns, train=False)
    )
    assert seen and seen[0] is None


@pytest.mark.parametrize(
    "document_ids, labels, message",
    [
        ("document_id", None, 'document_ids must be "label"'),
        ("label", None, "no label column"),
        ("label", torch.zeros(BATCH), "one integer per row"),
        ("label", torch.arange(BATCH + 1), "one integer per row"),
    ],
)
def test_bad_document_ids_are_refused_in_one_line(model, document_ids, labels, message):
    with pytest.raises(ValueError, match=message) as raised:
        loss = CachedMultipleNegativesRankingLoss(model, mini_batch_size=2, document_ids=document_ids)
        loss(features_of(model, text_columns(BATCH, 2)), labels)
    assert "\n" not in str(raised.value)


def test_options_the_masked_scoring_does_not_follow_are_refused(model):
    if "hardness_mode" not in inspect.signature(upstream.CachedMultipleNegativesRankingLoss).parameters:
        pytest.skip(f"sentence-transformers {ST_VERSION} has no hardness_mode")
    with pytest.raises(ValueError, match="leave them at their defaults") as raised:
        CachedMultipleNegativesRankingLoss(
            model, hardness_mode="all_negatives", hardness_strength=1.0, document_ids="label"
        )
    assert "\n" not in str(raised.value)


def test_upstream_matryoshka_over_the_masked_loss_is_refused(model):
    loss = upstream.MatryoshkaLoss(
        model, CachedMultipleNegativesRankingLoss(model, mini_batch_size=2, document_ids="label"), [32, 16]
    )
    if "calculate_loss" not in vars(loss.loss):
        pytest.skip(f"sentence-transformers {ST_VERSION}'s MatryoshkaLoss does not decorate the cached loss")
    with pytest.raises(TypeError, match="use st_ext.losses.MatryoshkaLoss"):
        loss(features_of(model, text_columns(BATCH, 2)), DOCUMENTS)


# ---------------------------------------------------------------------------------------------
# Cross-batch memory


def upstream_ranking(model, cached: bool):
    if cached:
        return upstream.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2)
    return upstream.MultipleNegativesRankingLoss(model)


@pytest.mark.parametrize("cached", [False, True], ids=["mnrl", "cached"])
def test_memory_masks_queued_documents_of_the_anchors_document(model, cached):
    inner = upstream_ranking(model, cached)
    loss = CrossBatchMemoryLoss(model, inner, memory_size=64, document_ids="label")
    first_ids = torch.tensor([7, 30, 31, 32, 2, 33])
    with torch.enable_grad():
        loss(features_of(model, text_columns(BATCH, 3, seed=1)), first_ids)
    queued = loss.memory_embeddings.clone()
    queued_ids = torch.cat([first_ids, torch.full((BATCH,), -1)])
    assert torch.equal(loss.memory.document_ids, queued_ids.unsqueeze(1))  # one key per row: ids from the labels
    columns = text_columns(BATCH, 3, seed=2)
    expected = loss_and_grads(
        model, by_hand(model, DOCUMENTS, queued_documents=queued, queued_ids=queued_ids), columns, train=False
    )
    assert_same_grads(loss_and_grads(model, with_labels(loss, DOCUMENTS), columns, train=False), expected)


@pytest.mark.parametrize("cached", [False, True], ids=["mnrl", "cached"])
def test_a_repeated_row_is_not_its_own_negative(model, cached):
    """Rows 0 and 5 are one row twice: each one's positive is the other's target, never its negative."""
    inner = upstream_ranking(model, cached)
    loss = CrossBatchMemoryLoss(model, inner, memory_size=64)
    columns = text_columns(BATCH, 3, seed=5)
    columns[0][5], columns[1][5] = columns[0][0], columns[1][0]
    rows = torch.tensor([0, 1, 2, 3, 4, 0])
    expected = loss_and_grads(model, by_hand(model, rows), columns, train=False)
    assert_same_grads(loss_and_grads(model, loss, columns, train=False), expected)
    assert not torch.isclose(loss_and_grads(model, inner, columns, train=False)[0], expected[0])


def repeating_batches(batch_size: int) -> tuple[Dataset, list[list[int]]]:
    """A dataset whose duplicate-free batches cannot fill an epoch in one pass, and the batches 6.2's
    NoDuplicatesBatchSampler draws from it: later batches repeat rows of earlier ones."""
    from sentence_transformers.sampler import NoDuplicatesBatchSampler

    # Half the rows share one positive, and a batch holds at most one of them: a pass yields fewer batches
    # than the sampler's length, and it draws the rest in another pass, over rows already trained on.
    texts = random_texts(24 + 13, seed=11)
    anchors, positives = texts[:24], [texts[25 + i // 2] if i % 2 else texts[24] for i in range(24)]
    dataset = Dataset.from_dict({"anchor": anchors, "positive": positives})
    sampler = NoDuplicatesBatchSampler(dataset, batch_size=batch_size, drop_last=True, seed=3)
    return dataset, list(sampler)


def test_rows_the_sampler_repeats_never_meet_their_positive_in_the_queue(model):
    if ST_VERSION < Version("6.2.0"):
        pytest.skip(
            f"sentence-transformers {ST_VERSION}'s NoDuplicatesBatchSampler does not refill batches with earlier rows"
        )
    dataset, batches = repeating_batches(batch_size=4)
    assert len({index for batch in batches for index in batch}) < sum(map(len, batches)), "no row repeated"
    loss = CrossBatchMemoryLoss(model, upstream.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2), 256)
    model.eval()
    met_own_positive = 0
    for batch in batches:
        columns = [[dataset[index][name] for index in batch] for name in ("anchor", "positive")]
        features = features_of(model, columns)
        queue, queued_keys = loss.memory_embeddings, loss.memory_labels
        if queue is None:
            expected_queue = None
        else:
            own = torch.isin(queued_keys, document_keys(features[1]))
            met_own_positive += int(own.any())
            expected_queue = queue[~own]
        with torch.no_grad():
            anchors, positives = [model(f)["sentence_embedding"] for f in features]
            expected = ranking_loss_by_hand(anchors, [positives], queued_documents=expected_queue)
        with torch.enable_grad():
            torch.testing.assert_close(loss(features, None).detach(), expected)
    assert met_own_positive, "no batch found a copy of its own positive in the queue: the check proved nothing"


# ---------------------------------------------------------------------------------------------
# GIST


def gist_by_hand(model, guide, anchor_ids, temperature=0.05):
    """GISTEmbed's cross-entropy with the guide's suppression (margin 0) and same-document masking."""

    def loss(features, _labels):
        anchors, positives = [F.normalize(model(f)["sentence_embedding"], dim=-1) for f in features]
        with torch.no_grad():
            guide_anchors, guide_positives = [F.normalize(guide(f)["sentence_embedding"], dim=-1) for f in features]
        rows = torch.arange(len(anchors))
        same = (anchor_ids[:, None] == anchor_ids[None, :]) & (anchor_ids[:, None] >= 0)
        guide_ap = guide_anchors @ guide_positives.T
        limit = guide_ap[rows, rows][:, None]
        suppress_ap = (guide_ap > limit) | same
        suppress_ap[rows, rows] = False
        suppress_aa = (guide_anchors @ guide_anchors.T > limit) | same
        suppress_pp = (guide_positives @ guide_positives.T > limit) | same
        scores = torch.cat(
            [
                (anchors @ positives.T).masked_fill(suppress_ap, float("-inf")),
                (anchors @ anchors.T).masked_fill(suppress_aa, float("-inf")),
                (positives @ positives.T).masked_fill(suppress_pp, float("-inf")),
            ],
            dim=1,
        )
        return F.cross_entropy(scores / temperature, rows)

    return loss


@pytest.mark.parametrize("cached", [False, True], ids=["gist", "cached-gist"])
def test_gist_masks_candidates_of_the_anchors_document(model, guide, cached):
    options = {"temperature": 0.05, "document_ids": "label"}
    if cached:
        loss = CachedGISTEmbedLoss(model, guide, mini_batch_size=2, **options)
    else:
        loss = GISTEmbedLoss(model, guide, **options)
    columns = text_columns(BATCH, 2, seed=6)
    expected = loss_and_grads(model, gist_by_hand(model, guide, DOCUMENTS), columns, train=False)
    assert_same_grads(loss_and_grads(model, with_labels(loss, DOCUMENTS), columns, train=False), expected)
    unmasked = loss_and_grads(model, gist_by_hand(model, guide, torch.full((BATCH,), -1)), columns, train=False)
    assert not torch.isclose(unmasked[0], expected[0])


def test_masking_applies_in_every_direction(model):
    directions = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
    if "directions" not in inspect.signature(upstream.CachedMultipleNegativesRankingLoss).parameters:
        pytest.skip(f"sentence-transformers {ST_VERSION}'s ranking losses have no directions")
    loss = CachedMultipleNegativesRankingLoss(model, mini_batch_size=2, directions=directions, document_ids="label")

    def reference(features, _labels):
        anchors, *documents = [model(f)["sentence_embedding"] for f in features]
        ids = torch.cat([DOCUMENTS, torch.full_like(DOCUMENTS, -1)])
        return ranking_loss_by_hand(
            anchors, documents, directions=directions, anchor_ids=DOCUMENTS, document_ids=ids, query_ids=DOCUMENTS
        )

    columns = text_columns(BATCH, 3, seed=8)
    assert_same_grads(
        loss_and_grads(model, with_labels(loss, DOCUMENTS), columns, train=False),
        loss_and_grads(model, reference, columns, train=False),
    )
