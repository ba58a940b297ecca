"""Partial caching: the first mini-batches keep their graphs for the backward, the others are replayed.

For every number of kept graphs (none, some, all) each cached loss gives the uncached loss's value and
gradients with dropout off, and with dropout on the same step as embedding the same mini-batches with
a graph in the same order (what keeping every graph does); a kept mini-batch is embedded once, a
replayed one twice; the kept graphs do not outlive the backward; ``mini_batch_size="auto"`` keeps as
many as its measured budget holds, within that budget. DDP, FSDP2 and ZeRO are in
tests/test_engine_parity.py and tests/test_distributed.py (their ``partial`` cases).
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch
from loss_checks import (
    assert_same_grads,
    features_of,
    grads_differ,
    loss_and_grads,
    steady_step_peak,
    text_columns,
)
from test_cached_mechanics import live_tensors

from st_ext import losses
from st_ext._compat import st_losses
from st_ext.losses import auto_mini_batch
from st_ext.losses.auto_mini_batch import EXPECTED_MARGIN
from st_ext.losses.features import layout_of
from st_ext.losses.registry import build_loss
from st_ext.memory import measure_peak

upstream = st_losses()
pytestmark = pytest.mark.usefixtures("one_torch_thread")

BATCH = 8
MINI_BATCH = 3
#: 8 rows in 3 columns share forward passes: 24 rows in mini-batches of 3, 3, ..., 3.
MINI_BATCHES = 8
DIMS = [32, 16, 8]
#: None, one, most and every graph kept (past every one: the same as every one).
KEPT = [0, 1, 5, MINI_BATCHES, 100]


def cmnrl(model, kept):
    return losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=MINI_BATCH, kept_graphs=kept)


def cached_gist(model, guide, kept):
    return losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=MINI_BATCH, kept_graphs=kept)


#: name: (st_ext's cached loss keeping ``kept`` graphs, upstream's uncached reference)
CASES = {
    "matryoshka-cmnrl": (
        lambda m, g, kept: losses.MatryoshkaLoss(m, cmnrl(m, kept), DIMS),
        lambda m, g: upstream.MatryoshkaLoss(m, upstream.MultipleNegativesRankingLoss(m), DIMS),
    ),
    "cached-gist": (
        lambda m, g, kept: cached_gist(m, g, kept),
        lambda m, g: upstream.GISTEmbedLoss(m, g),
    ),
    "matryoshka-cached-gist": (
        lambda m, g, kept: losses.MatryoshkaLoss(m, cached_gist(m, g, kept), DIMS, [1.0, 0.5, 0.25]),
        lambda m, g: upstream.MatryoshkaLoss(m, upstream.GISTEmbedLoss(m, g), DIMS, [1.0, 0.5, 0.25]),
    ),
    "layer-wise": (
        lambda m, g, kept: losses.AdaptiveLayerLoss(m, cmnrl(m, kept), n_layers_per_step=-1),
        lambda m, g: upstream.AdaptiveLayerLoss(m, upstream.MultipleNegativesRankingLoss(m), n_layers_per_step=-1),
    ),
    "cross-batch-memory": (
        lambda m, g, kept: losses.CrossBatchMemoryLoss(m, cmnrl(m, kept), memory_size=64),
        lambda m, g: losses.CrossBatchMemoryLoss(m, upstream.MultipleNegativesRankingLoss(m), memory_size=64),
    ),
}


def two_steps(model, loss, *, train: bool) -> list:
    """Two steps' values and gradients (the second sees a cross-batch memory's queue filled by the first)."""
    return [loss_and_grads(model, loss, text_columns(BATCH, 3, seed=seed), train=train) for seed in (1, 2)]


@pytest.mark.parametrize("kept", KEPT)
@pytest.mark.parametrize("name", list(CASES))
def test_every_number_of_kept_graphs_gives_the_uncached_gradients(model4, guide, name, kept):
    cached, reference = CASES[name]
    actual = two_steps(model4, cached(model4, guide, kept), train=False)
    expected = two_steps(model4, reference(model4, guide), train=False)
    for step_actual, step_expected in zip(actual, expected):
        assert_same_grads(step_actual, step_expected)


@pytest.mark.parametrize("kept", [0, 1, 5])
@pytest.mark.parametrize("name", list(CASES))
def test_with_dropout_kept_and_replayed_graphs_give_the_same_step(model4, guide, name, kept):
    """With dropout on, keeping every graph is the uncached loss over the same forward passes in the same
    order; keeping fewer (replaying the others under their recorded RNG states) gives the same gradients."""
    cached, _ = CASES[name]
    every_graph = two_steps(model4, cached(model4, guide, MINI_BATCHES), train=True)
    actual = two_steps(model4, cached(model4, guide, kept), train=True)
    for step_actual, step_expected in zip(actual, every_graph):
        assert_same_grads(step_actual, step_expected)
    # The premise: dropout changes the step, so a replay under another RNG state would show.
    assert grads_differ(every_graph[0], two_steps(model4, cached(model4, guide, kept), train=False)[0])


def forward_passes(model, loss, columns) -> tuple[int, int, int]:
    """Forward passes of one step: with a graph before ``backward()``, without one, and inside it (replays)."""
    passes = {"graph": 0, "no_graph": 0, "replay": 0}
    in_backward = [False]

    def count(module, args, output):
        kind = "replay" if in_backward[0] else "graph" if torch.is_grad_enabled() else "no_graph"
        passes[kind] += 1

    handle = model.register_forward_hook(count)
    try:
        value = loss(features_of(model, columns), None)
        in_backward[0] = True
        value.backward()
    finally:
        handle.remove()
    return passes["graph"], passes["no_graph"], passes["replay"]


@pytest.mark.parametrize("kept", [0, 1, 5, MINI_BATCHES])
def test_a_kept_mini_batch_is_embedded_once(model, kept):
    # Rows of one length: the columns share forward passes (no padding), MINI_BATCHES of them.
    passes = forward_passes(model, cmnrl(model, kept), text_columns(BATCH, 3, min_words=8, max_words=8))
    replayed = MINI_BATCHES - kept
    assert passes == (kept, replayed, replayed)


def test_kept_graphs_do_not_outlive_the_backward(model):
    """After ``backward()``, while the trainer still holds the loss tensor, a step that kept graphs holds no
    more of its tensors than one that kept none: the graphs (their outputs, what they saved) are gone."""

    def held_after_backward(kept: int) -> int:
        loss = cmnrl(model, kept)
        columns = text_columns(BATCH, 3)
        loss(features_of(model, columns), None).backward()  # lazily built caches exist from here on
        model.zero_grad(set_to_none=True)
        features = features_of(model, columns)
        gc.collect()
        before = live_tensors()
        value = loss(features, None)
        value.backward()
        model.zero_grad(set_to_none=True)
        gc.collect()
        held = [key for key, ref in live_tensors().items() if key not in before and ref() is not None]
        del value
        return len(held)

    model.train()
    assert held_after_backward(5) == held_after_backward(0)


def auto_cmnrl(model, budget_bytes: float):
    return losses.CachedMultipleNegativesRankingLoss(
        model, mini_batch_size="auto", memory_budget_mb=budget_bytes / 2**20
    )


def test_auto_keeps_the_graphs_its_budget_holds_within_that_budget(model, caplog):
    """Under a budget between two sizes' steps, the auto mode takes the smaller and keeps as many of its graphs
    as the budget holds (the first costs the step nothing: it stands in for a replayed one), says so once,
    embeds only the others twice, stays within the budget on the meter (the step that measures included),
    measures the peak it expected and gives the uncached gradients."""
    columns = text_columns(16, 2, min_words=10, max_words=14)
    features = features_of(model, columns)

    def step_peak(loss) -> int:
        model.zero_grad(set_to_none=True)
        with measure_peak("cpu") as peak:
            loss(features, None).backward()
        return peak.peak_bytes

    at_8 = step_peak(losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=8))
    at_16 = step_peak(losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=16))
    budget = (at_8 + at_16) / 2
    loss = auto_cmnrl(model, budget)
    with caplog.at_level(logging.INFO, logger="st_ext.losses.auto_mini_batch"):
        assert step_peak(loss) <= budget, "the first step, which measures, stays within the budget too"
        loss(features, None).backward()
    choice = loss.auto_mini_batch.choice
    assert choice.size == 8 and choice.kept >= 1, choice
    assert choice.one_more_bytes is None or choice.one_more_bytes > budget, "one more graph would not fit"
    assert [record.getMessage() for record in caplog.records] == [str(choice)]
    assert f"{choice.minibatches} forward passes of at most 8 texts each" in str(choice)
    assert f"the first {choice.kept} keep their graphs" in str(choice)
    measured = steady_step_peak(model, loss, features)
    assert measured <= budget, choice
    assert abs(measured - choice.expected_bytes) <= EXPECTED_MARGIN * choice.expected_bytes, (choice, measured)
    graph, no_graph, replayed = forward_passes(model, loss, columns)
    assert (graph, no_graph, replayed) == (choice.kept, choice.minibatches - choice.kept, no_graph)
    reference = upstream.MultipleNegativesRankingLoss(model)
    assert_same_grads(
        loss_and_grads(model, loss, columns, train=False), loss_and_grads(model, reference, columns, train=False)
    )


def test_auto_expects_the_peak_the_step_measures_for_every_count_of_kept_graphs(model):
    """What the auto mode measures at a size gives, for every count of kept graphs, the peak a step keeping
    that many then measures; and keeping graphs costs more once they no longer stand in for replayed ones."""
    features = features_of(model, text_columns(16, 2, min_words=10, max_words=14))
    layouts = [layout_of(column) for column in features]
    series = auto_mini_batch._Series(model, features, layouts, 32, 2**40, torch.device("cpu"))
    series.largest_fitting(8)
    costs = series.kept_graph_costs(8)
    assert costs is not None
    expected = series.peaks_by_kept_graphs(8, costs)
    assert expected == sorted(expected) and expected[-1] > expected[0], expected
    for kept, figure in enumerate(expected):
        loss = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=8, kept_graphs=kept)
        measured = steady_step_peak(model, loss, features)
        assert abs(measured - figure) <= EXPECTED_MARGIN * figure, (kept, measured, figure)


def test_kept_graphs_reach_the_loss_through_build_loss(model):
    loss = build_loss("cached_mnrl", model, mini_batch_size=4, kept_graphs=2)
    assert loss.kept_graphs == 2 and loss.cached_loss().kept_graphs == 2


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(mini_batch_size=4, kept_graphs=-1), "kept_graphs must be a whole number"),
        (dict(mini_batch_size=4, kept_graphs=0.5), "kept_graphs must be a whole number"),
        (dict(mini_batch_size="auto", kept_graphs=2), "leave kept_graphs at None"),
    ],
)
def test_settings_no_cached_loss_takes_are_refused(model, guide, settings, message):
    with pytest.raises(ValueError, match=message):
        losses.CachedMultipleNegativesRankingLoss(model, **settings)
    with pytest.raises(ValueError, match=message):
        losses.CachedGISTEmbedLoss(model, guide, **settings)
