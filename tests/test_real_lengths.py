"""Cached losses at realistic lengths: short queries beside long passages.

A forward pass shared by several columns is padded to its longest row, so columns share one only where
that costs no padding; then a cached loss whose mini-batch holds the whole batch peaks no higher than the
uncached loss on the same rows, ``mini_batch_size="auto"`` without a budget never above no caching, and
with a budget the peak it expects is the one the step measures (benchmarks/bench_real_lengths.py
measures the same on all-MiniLM-L6-v2).
"""

from __future__ import annotations

import logging

import pytest
from loss_checks import assert_same_grads, features_of, loss_and_grads, steady_step_peak, text_columns

from st_ext import losses
from st_ext._compat import st_losses
from st_ext.losses.auto_mini_batch import EXPECTED_MARGIN
from st_ext.losses.features import layout_of, minibatch_features
from st_ext.losses.minibatches import plan_minibatches

pytestmark = pytest.mark.usefixtures("one_torch_thread")
upstream = st_losses()
PAIRS = 16


def queries_and_passages(seed: int = 0) -> list[list[str]]:
    """Queries of 3-4 words, passages of 13-16 (one token a word): about a quarter of their length."""
    queries = text_columns(PAIRS, 1, seed=seed, min_words=3, max_words=4)[0]
    passages = text_columns(PAIRS, 1, seed=seed + 1, min_words=13, max_words=16)[0]
    return [queries, passages]


def widths_of(features, plan) -> list[tuple[int, int]]:
    """(rows, width) of every forward pass the plan makes."""
    return [tuple(minibatch_features(features, plan.layouts, mb)["input_ids"].shape) for mb in plan.minibatches]


def test_columns_of_different_widths_never_share_a_padded_pass(model):
    features = features_of(model, queries_and_passages())
    layouts = [layout_of(f) for f in features]
    query_width, passage_width = (int(layout.ends.max()) for layout in layouts)
    assert query_width < passage_width
    whole = plan_minibatches(features, layouts, 2 * PAIRS)
    assert whole.single_pass and not whole.merged
    assert widths_of(features, whole) == [(PAIRS, query_width), (PAIRS, passage_width)]
    # A mini-batch straddling the two columns is split where the two would pad each other.
    straddling = plan_minibatches(features, layouts, 12)
    assert all(len({segment.column for segment in mb}) == 1 for mb in straddling.minibatches)
    assert sum(rows for rows, _ in widths_of(features, straddling)) == 2 * PAIRS


def test_columns_of_one_width_still_share_passes(model):
    features = features_of(model, text_columns(PAIRS, 2, min_words=8, max_words=8))
    plan = plan_minibatches(features, [layout_of(f) for f in features], 2 * PAIRS)
    assert plan.merged and len(plan.minibatches) == 1


def test_one_pass_over_short_queries_equals_and_peaks_no_higher_than_the_uncached_loss(model):
    columns = queries_and_passages()
    cached = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2 * PAIRS)
    uncached = upstream.MultipleNegativesRankingLoss(model)
    assert_same_grads(
        loss_and_grads(model, cached, columns, train=True), loss_and_grads(model, uncached, columns, train=True)
    )
    model.train()
    features = features_of(model, columns)
    cached_peak, uncached_peak = steady_step_peak(model, cached, features), steady_step_peak(model, uncached, features)
    assert cached_peak <= 1.02 * uncached_peak, (cached_peak, uncached_peak)


def test_auto_without_a_budget_peaks_no_higher_than_no_caching(model):
    model.train()
    features = features_of(model, queries_and_passages(seed=2))
    auto = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size="auto")
    auto_peak = steady_step_peak(model, auto, features)
    uncached_peak = steady_step_peak(model, upstream.MultipleNegativesRankingLoss(model), features)
    assert auto.auto_mini_batch.choice.expected_bytes is None, "no budget: nothing measured, no figure to expect"
    assert auto_peak <= 1.02 * uncached_peak, (auto_peak, uncached_peak)


@pytest.mark.parametrize("share", [0.6, 1.5], ids=["tight", "loose"])
def test_auto_expects_the_peak_the_step_measures_and_logs_what_measuring_took(model, caplog, share):
    model.train()
    features = features_of(model, queries_and_passages(seed=3))
    uncached_peak = steady_step_peak(model, upstream.MultipleNegativesRankingLoss(model), features)
    budget = share * uncached_peak
    loss = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size="auto", memory_budget_mb=budget / 2**20)
    with caplog.at_level(logging.INFO, logger="st_ext.losses.auto_mini_batch"):
        measured = steady_step_peak(model, loss, features)
    choice = loss.auto_mini_batch.choice
    assert choice.expected_bytes is not None and measured <= budget, (choice, measured)
    assert abs(measured - choice.expected_bytes) <= EXPECTED_MARGIN * choice.expected_bytes, (choice, measured)
    assert choice.probe_seconds > 0
    assert [record.getMessage() for record in caplog.records] == [str(choice)]
    assert f"measuring took {choice.probe_seconds:.1f} s" in str(choice)
    assert "expected step peak" in str(choice)
    if share > 1:
        assert choice.size == 2 * PAIRS, "the loose budget holds the one pass, which no caching would take anyway"


def test_the_one_pass_probe_is_the_pass_the_engine_runs(model):
    """The whole batch is measured as the engine embeds it (a pass per column here), not as one padded pass."""
    features = features_of(model, queries_and_passages(seed=4))
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(tuple(args[0]["input_ids"].shape)))
    loss = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size="auto", memory_budget_mb=4096)
    model.train()
    loss(features, None).backward()
    layouts = [layout_of(f) for f in features]
    per_column = [(PAIRS, int(layout.ends.max())) for layout in layouts]
    assert loss.auto_mini_batch.choice.size == 2 * PAIRS
    assert (2 * PAIRS, per_column[1][1]) not in seen, "no probe padded the queries to the passages' width"
    assert seen[-2:] == per_column, "the step: one pass per column"
