"""What ``mini_batch_size="auto"`` logs about kept graphs is what keeping them then measures.

The auto mode keeps the graphs of the step's first mini-batches that its budget holds, and logs what each adds to
the step's peak (with none kept, what keeping one would add). Here the figure is checked against the CPU meter
(``st_ext.memory.measure_peak``): the step with the graphs kept, less the same step with none kept, is the
logged figure times the graphs, within :data:`EXPECTED_MARGIN` of the step's peak; the step stays within its
budget. The first graphs often add nothing (their activations are freed before the replayed mini-batches
allocate the parameters' gradients), so a figure charged per graph from a forward pass's size would tell a
reader that keeping one costs what it does not.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from loss_checks import features_of, text_columns

from st_ext import checkpointing, losses
from st_ext.losses.auto_mini_batch import EXPECTED_MARGIN, _graph_bytes
from st_ext.memory import measure_peak

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PAIRS = 16


def step_peak(model, loss, features) -> int:
    """The CPU meter's peak of one forward and backward, after a step that builds caches (and measures, in
    the auto mode)."""
    model.zero_grad(set_to_none=True)
    loss(features, None).backward()
    model.zero_grad(set_to_none=True)
    with measure_peak("cpu") as peak:
        loss(features, None).backward()
    model.zero_grad(set_to_none=True)
    return peak.peak_bytes


def fixed_step_peak(model, features, choice, kept: int) -> int:
    """The step at the auto mode's choice with a fixed number of kept graphs."""
    loss = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=choice.size, kept_graphs=kept)
    with checkpointing.switched_on(model) if choice.checkpointing else contextlib.nullcontext():
        return step_peak(model, loss, features)


#: name: the batch's (anchor, positive) columns
BATCHES = {
    "equal-lengths": lambda: text_columns(PAIRS, 2, min_words=10, max_words=14),
    "short-queries": lambda: [
        text_columns(PAIRS, 1, seed=5, min_words=3, max_words=4)[0],
        text_columns(PAIRS, 1, seed=6, min_words=13, max_words=16)[0],
    ],
}


@pytest.mark.parametrize("batch", list(BATCHES))
def test_the_logged_cost_of_a_kept_graph_is_what_keeping_it_measures(model, caplog, batch):
    model.train()
    features = features_of(model, BATCHES[batch]())
    quarter, half = (
        step_peak(model, losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=size), features)
        for size in (PAIRS // 2, PAIRS)
    )
    budget = (quarter + half) / 2
    loss = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size="auto", memory_budget_mb=budget / 2**20)
    with caplog.at_level(logging.INFO, logger="st_ext.losses.auto_mini_batch"):
        measured = step_peak(model, loss, features)
    choice = loss.auto_mini_batch.choice
    assert choice.size < 2 * PAIRS and choice.kept_graph_bytes is not None, choice
    assert measured <= budget, (choice, measured)
    assert [record.getMessage() for record in caplog.records] == [str(choice)]

    none_kept = fixed_step_peak(model, features, choice, 0)
    graphs = choice.kept or 1
    with_graphs = measured if choice.kept else fixed_step_peak(model, features, choice, 1)
    added = with_graphs - none_kept
    assert abs(added - graphs * choice.kept_graph_bytes) <= EXPECTED_MARGIN * with_graphs, (choice, added)
    if choice.kept:
        assert f"the first {choice.kept} keep their graphs (each adds " in str(choice)
    else:
        assert "keeping one would add" in str(choice)


def test_a_graph_is_counted_by_the_storages_it_saves_and_then_released(model):
    """The bound on a further kept graph: what autograd saves for one forward pass (the parameters excepted),
    near the peak of that forward, and nothing of it alive afterwards."""
    model.train()
    features = features_of(model, text_columns(8, 1, min_words=12, max_words=12))[0]
    with measure_peak("cpu") as forward:
        model(dict(features))["sentence_embedding"]
    with measure_peak("cpu") as counting:  # twice: a graph left alive by the first would double the peak
        saved = _graph_bytes(model, features, torch.device("cpu"))
        assert _graph_bytes(model, features, torch.device("cpu")) == saved
    assert 0.5 * forward.peak_bytes < saved <= forward.peak_bytes, (saved, forward.peak_bytes)
    assert counting.peak_bytes <= 1.05 * forward.peak_bytes, (counting.peak_bytes, forward.peak_bytes)
