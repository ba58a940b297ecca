"""Cross-batch memory under Matryoshka and layer-wise losses: a queue per layer, truncated per dimension.

With empty queues each loss is the plain cached one; after a step every layer's queue holds that
layer's documents; with filled queues the cached path (several mini-batches) equals the one-pass
path (the plain forward and backward through the same loss over embeddings), and the queues change
the loss. Evaluation leaves the queues alone.
"""

from __future__ import annotations

import pytest
import torch
from loss_checks import assert_losses_agree, features_of, grads_differ, loss_and_grads, text_columns

from st_ext import losses
from st_ext._compat import AdaptiveLayerRules
from st_ext.losses.layer_embeddings import LayerEmbeddings

BATCH = 8
DIMS = [32, 16, 8]


def memory_over_cached(model, mini_batch_size, **kwargs):
    inner = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=mini_batch_size)
    return losses.CrossBatchMemoryLoss(model, inner, memory_size=64, **kwargs)


WRAPPERS = {
    "adaptive": lambda model, inner: losses.AdaptiveLayerLoss(model, inner, n_layers_per_step=-1),
    "matryoshka-2d": lambda model, inner: losses.Matryoshka2dLoss(
        model, inner, DIMS, n_layers_per_step=-1, n_dims_per_step=-1
    ),
    "matryoshka": lambda model, inner: losses.MatryoshkaLoss(model, inner, DIMS),
}


def fill(loss, model, seed: int) -> None:
    """One training step on another batch: the queues fill."""
    model.train(False)
    loss(features_of(model, text_columns(BATCH, 2, seed=seed)), None).backward()
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_empty_queues_give_the_plain_cached_loss(model4, wrapper):
    columns = text_columns(BATCH, 2)
    wrap = WRAPPERS[wrapper]
    plain = wrap(model4, losses.CachedMultipleNegativesRankingLoss(model4, mini_batch_size=3))
    assert_losses_agree(model4, wrap(model4, memory_over_cached(model4, 3)), plain, columns, train=False)


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_filled_queues_cached_equals_one_pass_and_change_the_loss(model4, wrapper):
    wrap = WRAPPERS[wrapper]
    cached_memory, one_pass_memory = memory_over_cached(model4, 3), memory_over_cached(model4, 10 * BATCH)
    cached, one_pass = wrap(model4, cached_memory), wrap(model4, one_pass_memory)
    fill(cached, model4, seed=11)
    one_pass_memory.load_memory_state(cached_memory.memory_state())
    columns = text_columns(BATCH, 2)
    state = cached_memory.memory_state()
    with_queues = loss_and_grads(model4, cached, columns, train=False)
    cached_memory.load_memory_state(state)
    assert_losses_agree(model4, cached, one_pass, columns, train=False)
    empty = wrap(model4, memory_over_cached(model4, 3))
    assert grads_differ(with_queues, loss_and_grads(model4, empty, columns, train=False))


def test_each_layer_queues_its_own_documents(model4):
    memory = memory_over_cached(model4, 3)
    loss = losses.AdaptiveLayerLoss(model4, memory, n_layers_per_step=-1)
    columns = text_columns(BATCH, 3)
    model4.eval()
    loss(features_of(model4, columns), None).backward()

    # Each document column embedded on its own, through every layer the loss sampled.
    encoder = LayerEmbeddings(lambda num_hidden_states: sorted(memory.layer_memory))
    with torch.no_grad():
        documents = [encoder(model4, features) for features in features_of(model4, columns[1:])]
    sampled = len(model4[0].auto_model.encoder.layer) - AdaptiveLayerRules.first_hidden_state
    assert len(memory.layer_memory) == sampled
    torch.testing.assert_close(memory.memory.embeddings, torch.cat([outputs[0] for outputs in documents]))
    for index, layer in enumerate(sorted(memory.layer_memory)):
        expected = torch.cat([outputs[index + 1] for outputs in documents])
        torch.testing.assert_close(memory.layer_memory[layer].embeddings, expected)
        assert torch.equal(memory.layer_memory[layer].labels, memory.memory.labels)


def test_evaluation_leaves_the_queues_alone(model4):
    memory = memory_over_cached(model4, 3)
    loss = losses.Matryoshka2dLoss(model4, memory, DIMS, n_layers_per_step=-1)
    fill(loss, model4, seed=3)
    before = memory.memory_state()
    with torch.no_grad():
        loss(features_of(model4, text_columns(BATCH, 2)), None)
    after = memory.memory_state()
    assert before.keys() == after.keys() and before["layers"].keys() == after["layers"].keys()
    assert torch.equal(before["embeddings"], after["embeddings"])
    for layer, state in before["layers"].items():
        assert torch.equal(state["embeddings"], after["layers"][layer]["embeddings"]), layer


def test_layer_queues_survive_a_state_round_trip(model4, tmp_path):
    memory = memory_over_cached(model4, 3)
    fill(losses.AdaptiveLayerLoss(model4, memory, n_layers_per_step=-1), model4, seed=5)
    torch.save(memory.memory_state(), tmp_path / "state.pt")
    restored = memory_over_cached(model4, 3)
    restored.load_memory_state(torch.load(tmp_path / "state.pt"))
    assert restored.layer_memory.keys() == memory.layer_memory.keys() and memory.layer_memory
    for layer, bank in memory.layer_memory.items():
        assert torch.equal(restored.layer_memory[layer].embeddings, bank.embeddings)
    restored.reset_memory()
    assert not restored.layer_memory and restored.memory.rows == 0


@pytest.mark.parametrize("wrapper", ["matryoshka", "matryoshka-2d"])
def test_the_queue_is_normalised_like_the_batch_at_every_dimension(model4, wrapper):
    """Matryoshka normalises the batch's embeddings at every dimension, the full one included: so is the
    queue, whatever the similarity (a raw queue of norm 3 under dot products would be another loss)."""
    from sentence_transformers.util import dot_score

    def memory():
        inner = losses.CachedMultipleNegativesRankingLoss(model4, mini_batch_size=3, similarity_fct=dot_score)
        return losses.CrossBatchMemoryLoss(model4, inner, memory_size=64)

    raw, normalised = memory(), memory()
    queued = torch.randn(12, 32) * 3
    keys = torch.arange(100, 112)
    state = {**raw.memory_state(), "embeddings": queued, "labels": keys}
    raw.load_memory_state(state)
    normalised.load_memory_state({**state, "embeddings": torch.nn.functional.normalize(queued, dim=-1)})
    build = {
        "matryoshka": lambda inner: losses.MatryoshkaLoss(model4, inner, [32]),
        "matryoshka-2d": lambda inner: losses.Matryoshka2dLoss(model4, inner, [32], kl_temperature=0.0),
    }[wrapper]
    columns = text_columns(BATCH, 2)
    assert_losses_agree(model4, build(raw), build(normalised), columns, train=False)


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_memory_around_the_uncached_loss_composes_as_around_the_cached_one(model4, wrapper):
    """Every memory runs on the engine: around MultipleNegativesRankingLoss, in one pass, each layer with its
    own queue and the queue truncated with the batch, as around the cached loss."""
    wrap = WRAPPERS[wrapper]
    cached_memory = memory_over_cached(model4, 3)
    plain_memory = losses.CrossBatchMemoryLoss(model4, losses.MultipleNegativesRankingLoss(model4), memory_size=64)
    cached, plain = wrap(model4, cached_memory), wrap(model4, plain_memory)
    fill(cached, model4, seed=11)
    plain_memory.load_memory_state(cached_memory.memory_state())
    assert_losses_agree(model4, cached, plain, text_columns(BATCH, 2), train=False)
