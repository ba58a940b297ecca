"""CrossBatchMemoryLoss(query_bank=True): earlier steps' anchors are candidates in the directions the wrapped
MultipleNegativesRankingLoss scores (ContAccum's bank of queries and passages). Each value and gradient is
checked against the loss written by hand over the concatenated bank (tests/ranking_reference.py)."""

from __future__ import annotations

import pytest
import torch
from loss_checks import assert_same_grads, features_of, loss_and_grads, text_columns
from ranking_reference import ranking_loss_by_hand

from st_ext._compat import ST_VERSION, st_losses
from st_ext.losses import MatryoshkaLoss
from st_ext.losses.cross_batch_memory import CrossBatchMemoryLoss

upstream = st_losses()
BATCH = 6


def has_directions() -> bool:
    import inspect

    return "directions" in inspect.signature(upstream.MultipleNegativesRankingLoss).parameters


needs_directions = pytest.mark.skipif(
    not has_directions(),
    reason=f"sentence-transformers {ST_VERSION}'s MultipleNegativesRankingLoss has no directions: no query bank",
)
pytestmark = pytest.mark.usefixtures("one_torch_thread")

DIRECTION_CASES = [
    pytest.param(("query_to_doc", "query_to_query"), "joint", id="q2q"),
    pytest.param(("query_to_doc", "doc_to_query"), "per_direction", id="d2q-per-direction"),
    pytest.param(("query_to_doc", "query_to_query", "doc_to_query"), "joint", id="q2q-d2q"),
]


def ranking(model, cached: bool, **options):
    if cached:
        return upstream.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2, **options)
    return upstream.MultipleNegativesRankingLoss(model, **options)


def filled(model, cached: bool, directions, partition_mode, num_columns: int = 3) -> CrossBatchMemoryLoss:
    loss = CrossBatchMemoryLoss(
        model,
        ranking(model, cached, directions=directions, partition_mode=partition_mode),
        memory_size=64,
        query_bank=True,
    )
    with torch.enable_grad():
        for seed in (1, 2):
            loss(features_of(model, text_columns(BATCH, num_columns, seed=seed)), None)
    return loss


@needs_directions
@pytest.mark.parametrize("cached", [False, True], ids=["mnrl", "cached"])
@pytest.mark.parametrize("directions, partition_mode", DIRECTION_CASES)
def test_query_bank_loss_equals_the_loss_over_the_concatenated_bank(model, cached, directions, partition_mode):
    loss = filled(model, cached, directions, partition_mode)
    queued_documents = loss.memory_embeddings.clone()
    queued_queries = loss.query_memory.embeddings.clone()
    assert len(queued_queries) == 2 * BATCH and len(queued_documents) == 2 * 2 * BATCH

    def by_hand(features, labels):
        anchors, *documents = [model(f)["sentence_embedding"] for f in features]
        return ranking_loss_by_hand(
            anchors,
            documents,
            queued_documents=queued_documents,
            queued_queries=queued_queries,
            directions=directions,
            partition_mode=partition_mode,
        )

    columns = text_columns(BATCH, 3, seed=3)
    expected = loss_and_grads(model, by_hand, columns, train=False)
    assert_same_grads(loss_and_grads(model, loss, columns, train=False), expected)
    # The bank matters: without the queued anchors the value differs.
    loss.query_memory = type(loss.query_memory)()
    assert not torch.isclose(loss_and_grads(model, loss, columns, train=False)[0], expected[0])


@needs_directions
def test_matryoshka_truncates_the_query_bank_with_the_batch(model):
    dims = [32, 16, 8]
    directions = ("query_to_doc", "query_to_query", "doc_to_query")
    memory = filled(model, True, directions, "joint", num_columns=2)
    loss = MatryoshkaLoss(model, memory, dims)
    queued_documents = memory.memory_embeddings.clone()
    queued_queries = memory.query_memory.embeddings.clone()

    def by_hand(features, labels):
        anchors, positives = [model(f)["sentence_embedding"] for f in features]
        return sum(
            ranking_loss_by_hand(
                anchors[:, :dim],
                [positives[:, :dim]],
                queued_documents=queued_documents[:, :dim],
                queued_queries=queued_queries[:, :dim],
                directions=directions,
            )
            for dim in dims
        )

    columns = text_columns(BATCH, 2, seed=3)
    assert_same_grads(
        loss_and_grads(model, loss, columns, train=False), loss_and_grads(model, by_hand, columns, train=False)
    )


@needs_directions
def test_a_queued_copy_of_an_anchor_is_not_its_negative(model):
    """The query bank holds an earlier copy of anchor 0's row: it is dropped from the candidates (by token ids
    of the row's positive), as a queued copy of its positive is."""
    directions = ("query_to_doc", "query_to_query")
    loss = CrossBatchMemoryLoss(model, ranking(model, False, directions=directions), 64, query_bank=True)
    first = text_columns(BATCH, 2, seed=1)
    with torch.enable_grad():
        loss(features_of(model, first), None)
    second = text_columns(BATCH, 2, seed=2)
    second[0][0], second[1][0] = first[0][3], first[1][3]
    kept = [row for row in range(BATCH) if row != 3]
    queued_documents = loss.memory_embeddings[kept].clone()
    queued_queries = loss.query_memory.embeddings[kept].clone()

    def by_hand(features, labels):
        anchors, positives = [model(f)["sentence_embedding"] for f in features]
        return ranking_loss_by_hand(
            anchors,
            [positives],
            queued_documents=queued_documents,
            queued_queries=queued_queries,
            directions=directions,
        )

    assert_same_grads(
        loss_and_grads(model, loss, second, train=False), loss_and_grads(model, by_hand, second, train=False)
    )


@needs_directions
def test_query_bank_is_saved_and_restored(model):
    directions = ("query_to_doc", "query_to_query")
    loss = filled(model, True, directions, "joint")
    state = loss.memory_state()
    restored = CrossBatchMemoryLoss(model, ranking(model, True, directions=directions), 64, query_bank=True)
    restored.load_memory_state(state)
    assert torch.equal(restored.query_memory.embeddings, loss.query_memory.embeddings)
    assert torch.equal(restored.query_memory.labels, loss.query_memory.labels)
    columns = text_columns(BATCH, 3, seed=4)
    assert_same_grads(
        loss_and_grads(model, restored, columns, train=False), loss_and_grads(model, loss, columns, train=False)
    )
    without_bank = {key: value for key, value in state.items() if key not in ("queries", "query_layers")}
    with pytest.raises(ValueError, match="saved state has none"):
        restored.load_memory_state(without_bank)


def test_query_bank_refusals_are_one_line(model):
    if has_directions():
        cases = [(ranking(model, True), "scores neither")]
    else:
        cases = [(ranking(model, True), f"sentence-transformers {ST_VERSION} lacks")]
    cases.append((upstream.BatchAllTripletLoss(model), "apply to ranking losses"))
    for inner, message in cases:
        with pytest.raises(ValueError, match=message) as raised:
            CrossBatchMemoryLoss(model, inner, 8, query_bank=True)
        assert "\n" not in str(raised.value)


@needs_directions
@pytest.mark.parametrize("cached", [False, True], ids=["mnrl", "cached"])
@pytest.mark.parametrize(
    "directions",
    [("query_to_doc", "query_to_query", "doc_to_query"), ("query_to_doc", "doc_to_doc")],
    ids=["q2q-d2q", "d2d"],
)
def test_other_directions_rank_against_the_queued_documents(model, cached, directions):
    """Without a query bank, directions beyond query_to_doc (refused before the memory scored itself) score
    the batch as the wrapped loss does, with the queued documents among each anchor's candidates."""
    loss = CrossBatchMemoryLoss(model, ranking(model, cached, directions=directions), memory_size=64)
    with torch.enable_grad():
        loss(features_of(model, text_columns(BATCH, 3, seed=1)), None)
    queued_documents = loss.memory_embeddings.clone()
    assert loss.query_memory.rows == 0

    def by_hand(features, labels):
        anchors, *documents = [model(f)["sentence_embedding"] for f in features]
        return ranking_loss_by_hand(anchors, documents, queued_documents=queued_documents, directions=directions)

    columns = text_columns(BATCH, 3, seed=3)
    assert_same_grads(
        loss_and_grads(model, loss, columns, train=False), loss_and_grads(model, by_hand, columns, train=False)
    )
