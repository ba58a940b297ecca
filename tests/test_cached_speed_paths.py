"""The fast paths of the GradCache engine give the uncached loss's values and gradients.

* one pass: when one mini-batch holds the whole batch, the cached loss runs one forward with a graph;
* merged columns: forward passes cut across columns, each padded to its own longest row;
* no device reads while planning and slicing mini-batches;
* ``mini_batch_size="auto"``: sized to a memory budget on the batch's longest rows, re-measured for
  longer batches, out-of-memory while measuring counted as over budget, the budget held on the meter.
"""

from __future__ import annotations

import contextlib
import math
import random

import pytest
import torch
from loss_checks import NoDeviceReads, assert_same_grads, features_of, loss_and_grads, text_columns
from sentence_transformers.util import fullname
from torch import nn

from st_ext import losses
from st_ext._compat import preprocess, separate_column_forwards, st_losses
from st_ext.losses import auto_mini_batch
from st_ext.losses.features import layout_of, minibatch_features
from st_ext.losses.minibatches import can_merge, plan_minibatches
from st_ext.memory import measure_peak
from st_ext.model_card import card_name

upstream = st_losses()
pytestmark = pytest.mark.usefixtures("one_torch_thread")
BATCH = 8
DIMS = [32, 16, 8]


def forward_counter(model) -> list[tuple[bool, int, int]]:
    """(with graph, rows, width) of every forward pass the model runs from now on."""
    calls = []
    model.register_forward_pre_hook(
        lambda module, args: calls.append((torch.is_grad_enabled(), *args[0]["input_ids"].shape))
    )
    return calls


class Replaying(nn.Module):
    """Stands in for the model inside an uncached upstream loss: returns precomputed embeddings, one column per call."""

    def __init__(self, model, reps):
        super().__init__()
        self.model = model
        self.reps = list(reps)

    def forward(self, features):
        return {"sentence_embedding": self.reps.pop(0)}

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.model, name)


def one_forward_reference(model, build_reference, columns, *, train: bool, seed: int = 1):
    """The uncached loss over embeddings from ONE forward pass over every column's rows, column after
    column: the pass a single-pass cached step runs (same rows, same padding, so the same dropout masks)."""
    model.zero_grad(set_to_none=True)
    model.train(train)
    features = features_of(model, columns)
    together = preprocess(model, [text for column in columns for text in column])
    torch.manual_seed(seed)
    random.seed(seed)
    reps = model(together)["sentence_embedding"].split([len(column) for column in columns])
    reference, replaying = build_reference(model), Replaying(model, reps)
    for loss in (reference, getattr(reference, "loss", None)):
        if isinstance(getattr(loss, "model", None), nn.Module):
            loss.model = replaying
    with separate_column_forwards():
        value = reference(features, None)
    value.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return value.detach(), grads


def equal_length_columns(batch_size: int, num_columns: int) -> list[list[str]]:
    """Columns whose rows all have one length (one token a word): they share forward passes without padding."""
    return text_columns(batch_size, num_columns, min_words=8, max_words=8)


def cmnrl(model, size, **kwargs):
    return losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=size, **kwargs)


# ---------------------------------------------------------------------------------------------
# One pass


@pytest.mark.parametrize("num_columns", [2, 3])
def test_one_pass_when_the_batch_fits_equals_the_uncached_loss_with_dropout(model, guide, num_columns):
    columns = equal_length_columns(BATCH, num_columns)
    rows = BATCH * num_columns
    cases = [
        (cmnrl(model, rows), lambda m: upstream.MultipleNegativesRankingLoss(m)),
        (
            losses.MatryoshkaLoss(model, cmnrl(model, rows), DIMS),
            lambda m: upstream.MatryoshkaLoss(m, upstream.MultipleNegativesRankingLoss(m), DIMS),
        ),
        (
            losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=rows),
            lambda m: upstream.GISTEmbedLoss(m, guide),
        ),
    ]
    calls = forward_counter(model)
    for cached, reference in cases:
        calls.clear()
        actual = loss_and_grads(model, cached, columns, train=True)
        assert [call[0] for call in calls] == [True], "one forward pass, with a graph, and no replay"
        assert_same_grads(actual, one_forward_reference(model, reference, columns, train=True))


def test_one_pass_holds_only_when_every_row_fits(model):
    columns = equal_length_columns(BATCH, 2)
    calls = forward_counter(model)
    loss_and_grads(model, cmnrl(model, 2 * BATCH - 1), columns, train=False)
    assert [with_graph for with_graph, *_ in calls] == [False, False, True, True]


# ---------------------------------------------------------------------------------------------
# Merged columns


@pytest.mark.parametrize("num_columns", [2, 3])
def test_merged_mini_batches_cut_across_columns_and_equal_the_uncached_loss(model, num_columns):
    columns = equal_length_columns(BATCH, num_columns)
    calls = forward_counter(model)
    actual = loss_and_grads(model, cmnrl(model, 6), columns, train=False)
    expected_passes = math.ceil(BATCH * num_columns / 6)
    assert [rows for with_graph, rows, _ in calls if not with_graph] == [6] * (expected_passes - 1) + [
        BATCH * num_columns - 6 * (expected_passes - 1)
    ]
    assert_same_grads(
        actual, loss_and_grads(model, upstream.MultipleNegativesRankingLoss(model), columns, train=False)
    )


def test_each_mini_batch_is_padded_to_its_own_longest_row(model):
    short = text_columns(BATCH, 1, seed=3, min_words=2, max_words=3)[0]
    long = text_columns(BATCH, 1, seed=4, min_words=12, max_words=14)[0]
    features = features_of(model, [short, long])
    layouts = [layout_of(f) for f in features]
    plan = plan_minibatches(features, layouts, 4)
    widths = [
        minibatch_features(features, plan.layouts, minibatch)["input_ids"].shape[1] for minibatch in plan.minibatches
    ]
    own = [int(layouts[0].ends[:4].max()), int(layouts[0].ends[4:].max())]
    own += [int(layouts[1].ends[:4].max()), int(layouts[1].ends[4:].max())]
    assert widths == own
    assert max(own[:2]) < features[1]["input_ids"].shape[1], "the short rows are not padded to the long ones"


def test_columns_that_cannot_share_a_pass_are_embedded_apart(model):
    features = features_of(model, text_columns(BATCH, 2))
    layouts = [layout_of(f) for f in features]
    assert can_merge(features, layouts)
    tasked = [{**features[0], "task": "query"}, {**features[1], "task": "document"}]
    assert not can_merge(tasked, [layout_of(f) for f in tasked])
    left = dict(features[1])
    left["attention_mask"] = left["attention_mask"].flip(1)
    left["input_ids"] = left["input_ids"].flip(1)
    left_layouts = [layouts[0], layout_of(left)]
    assert not left_layouts[1].right_padded
    assert not can_merge([features[0], left], left_layouts)
    plan = plan_minibatches([features[0], left], left_layouts, 6)
    assert all(len({segment.column for segment in minibatch}) == 1 for minibatch in plan.minibatches)


def test_planning_and_slicing_mini_batches_never_read_device_data(model):
    """Once a column's layout is taken (one copy per column per batch), cutting and building every
    mini-batch reads nothing back from the device: no per-mini-batch synchronisation on CUDA."""
    features = features_of(model, equal_length_columns(BATCH, 3))
    layouts = [layout_of(f) for f in features]
    guarded = [{k: v.as_subclass(NoDeviceReads) if torch.is_tensor(v) else v for k, v in f.items()} for f in features]
    with pytest.raises(AssertionError, match="read device data"):
        layout_of(guarded[0])  # the guard works
    for size, tokens in [(5, None), (4, 30)]:
        plan = plan_minibatches(guarded, layouts, size, tokens)
        assert plan.merged
        for minibatch in plan.minibatches:
            minibatch_features(guarded, plan.layouts, minibatch)


# ---------------------------------------------------------------------------------------------
# mini_batch_size="auto"


def test_auto_without_a_budget_on_the_cpu_runs_one_pass(model):
    columns = equal_length_columns(BATCH, 2)
    loss = cmnrl(model, "auto")
    calls = forward_counter(model)
    actual = loss_and_grads(model, loss, columns, train=True)
    assert [with_graph for with_graph, *_ in calls] == [True]
    assert loss.auto_mini_batch.choice.size == 2 * BATCH and loss.mini_batch_size == "auto"
    reference = one_forward_reference(model, lambda m: upstream.MultipleNegativesRankingLoss(m), columns, train=True)
    assert_same_grads(actual, reference)


def step_peak(model, loss, features) -> int:
    model.zero_grad(set_to_none=True)
    with measure_peak("cpu") as peak:
        loss(features, None).backward()
    return peak.peak_bytes


def test_auto_keeps_the_step_within_its_budget_on_the_meter(model):
    columns = text_columns(16, 2, min_words=10, max_words=14)
    features = features_of(model, columns)
    whole = step_peak(model, cmnrl(model, 32), features)
    small = step_peak(model, cmnrl(model, 4), features)
    budget = (small + whole) / 2
    loss = cmnrl(model, "auto", memory_budget_mb=budget / 2**20)
    loss(features, None).backward()  # the first step measures
    choice = loss.auto_mini_batch.choice
    assert 1 < choice.size < 32, choice
    assert step_peak(model, loss, features) <= budget, choice
    assert "mini_batch_size auto ->" in str(choice) and "torch.profiler" in str(choice)


@pytest.mark.parametrize("wrap", ["plain", "matryoshka", "gist"])
def test_auto_sized_losses_equal_the_uncached_loss(model, guide, wrap):
    columns = text_columns(BATCH, 3)
    budget_mb = 0.5
    if wrap == "gist":
        cached = losses.CachedGISTEmbedLoss(model, guide, mini_batch_size="auto", memory_budget_mb=budget_mb)
        reference = upstream.GISTEmbedLoss(model, guide)
    else:
        cached = cmnrl(model, "auto", memory_budget_mb=budget_mb)
        reference = upstream.MultipleNegativesRankingLoss(model)
        if wrap == "matryoshka":
            cached = losses.MatryoshkaLoss(model, cached, DIMS)
            reference = upstream.MatryoshkaLoss(model, reference, DIMS)
    assert_same_grads(
        loss_and_grads(model, cached, columns, train=False), loss_and_grads(model, reference, columns, train=False)
    )
    inner = cached.loss if wrap == "matryoshka" else cached
    assert 1 <= inner.auto_mini_batch.choice.size < 3 * BATCH, "the budget forces several mini-batches"


def test_out_of_memory_while_measuring_counts_as_over_budget(model, monkeypatch):
    """On the CPU, a meter that raises the CUDA out-of-memory error above 4 rows stands in for a full device."""
    real_measure_peak = auto_mini_batch.measure_peak
    emptied = []

    @contextlib.contextmanager
    def full_above_four_rows(device):
        with real_measure_peak(device) as peak:
            yield peak
        if probe_rows[-1] > 4:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    probe_rows = []
    real_probe = auto_mini_batch._probe_peak
    monkeypatch.setattr(auto_mini_batch, "measure_peak", full_above_four_rows)
    monkeypatch.setattr(
        auto_mini_batch,
        "_probe_peak",
        lambda m, f, d, passes, **graphs: (
            probe_rows.append(len(f["input_ids"])),
            real_probe(m, f, d, passes, **graphs),
        )[1],
    )
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    loss = cmnrl(model, "auto", memory_budget_mb=1024)
    columns = text_columns(BATCH, 2)
    value = loss(features_of(model, columns), None)
    value.backward()
    choice = loss.auto_mini_batch.choice
    assert choice.size == 4 and not choice.checkpointing
    # 8 rows ran out of memory, and again with checkpointing (the lever measures the size that fitted, then
    # the next size up); then a forward and backward from the step's first gradients (its forward measured
    # apart) and a forward without a graph, both of 4 rows, measure what keeping graphs of 4 costs.
    assert probe_rows == [1, 2, 4, 8, 4, 8, 4, 4] and choice.tried[8] == choice.tried["8+ckpt"] == -1
    assert "8: out of memory" in str(choice)


def test_auto_measures_again_only_for_a_longer_or_larger_batch(model):
    loss = cmnrl(model, "auto", memory_budget_mb=64)
    measured = []
    for columns in (
        text_columns(BATCH, 2, seed=1, max_words=6),
        text_columns(BATCH, 2, seed=2, max_words=5),
        text_columns(BATCH, 2, seed=3, min_words=12, max_words=14),
        text_columns(2 * BATCH, 2, seed=4, max_words=4),
    ):
        loss(features_of(model, columns), None).backward()
        measured.append(loss.auto_mini_batch.choice)
    assert measured[0] is measured[1] and measured[1] is not measured[2] and measured[2] is not measured[3]
    assert measured[2].longest_row > measured[0].longest_row and measured[3].rows == 4 * BATCH


def test_measuring_leaves_accumulated_gradients_alone(model):
    columns = text_columns(BATCH, 2)
    loss = cmnrl(model, "auto", memory_budget_mb=64)
    for parameter in model.parameters():
        parameter.grad = torch.full_like(parameter, 0.5)
    loss(features_of(model, columns), None)  # measures; no backward yet
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in model.parameters())


def test_measuring_leaves_the_random_state_alone(model):
    """With dropout on, the step that measures equals a step at the size and kept graphs it chose, from the
    same seed: the probes' forward passes draw no random numbers the step's dropout would have drawn."""
    columns = text_columns(BATCH, 3)
    auto = cmnrl(model, "auto", memory_budget_mb=0.5)
    actual = loss_and_grads(model, auto, columns, train=True)
    choice = auto.auto_mini_batch.choice
    assert choice.size < 3 * BATCH, "the budget forces several mini-batches"
    fixed = cmnrl(model, choice.size, kept_graphs=choice.kept)
    assert_same_grads(actual, loss_and_grads(model, fixed, columns, train=True))


def test_auto_errors_say_what_to_change(model):
    with pytest.raises(ValueError, match="even a mini-batch of one row .* Raise memory_budget_mb"):
        cmnrl(model, "auto", memory_budget_mb=1e-4)(features_of(model, text_columns(BATCH, 2)), None)
    with pytest.raises(ValueError, match="leave mini_batch_num_tokens at None"):
        losses.CachedGISTEmbedLoss(model, model, mini_batch_size="auto", mini_batch_num_tokens=100)
    with pytest.raises(ValueError, match="applies to mini_batch_size='auto' only"):
        cmnrl(model, 8, memory_budget_mb=100)
    with pytest.raises(ValueError, match="positive number of MiB"):
        losses.CachedGISTEmbedLoss(model, model, mini_batch_size="auto", memory_budget_mb=-1)
    with pytest.raises(ValueError, match="positive integer or 'auto'"):
        cmnrl(model, "big")


def test_auto_shows_in_the_model_card_config(model):
    loss = cmnrl(model, "auto", memory_budget_mb=256)
    assert loss.get_config_dict()["mini_batch_size"] == "auto"
    assert card_name(loss) == fullname(upstream.CachedMultipleNegativesRankingLoss(model))


def test_a_frozen_encoder_gets_each_column_in_the_planned_pieces(model):
    features = features_of(model, text_columns(BATCH, 2))
    plan = plan_minibatches(features, [layout_of(f) for f in features], 5)
    assert plan.column_ranges() == [[(0, 5), (5, 8)], [(0, 2), (2, 7), (7, 8)]]


def test_auto_may_checkpoint_a_larger_mini_batch_and_leaves_the_model_as_it_was(tmp_path, monkeypatch):
    """Where checkpointing lets a larger mini-batch fit the budget and the estimate calls it faster, auto
    checkpoints its graph passes only: the no-grad passes run plain, the model ends the step as it began,
    and the gradients are the uncached loss's."""
    from tiny_models import save_tiny_bert, sentence_transformer_from

    from st_ext import checkpointing

    # Training mode (transformers checkpoints only there), without dropout so the uncached loss compares.
    model = sentence_transformer_from(save_tiny_bert(tmp_path, num_layers=6, hidden_size=64, dropout=0.0)).train()
    columns = text_columns(16, 2, min_words=10, max_words=14)
    features = features_of(model, columns)
    layouts = [layout_of(f) for f in features]
    plain = auto_mini_batch._Series(model, features, layouts, 32, 2**40, torch.device("cpu"))
    plain.largest_fitting(1)
    budget = (plain.peaks[4] + plain.peaks[8]) / 2
    monkeypatch.setattr(auto_mini_batch._Series, "step_seconds", lambda self, size: 1.0 / (1 + self.checkpointed))
    loss = cmnrl(model, "auto", memory_budget_mb=budget / 2**20)
    passes = []
    model.register_forward_pre_hook(
        lambda module, args: passes.append((torch.is_grad_enabled(), checkpointing.is_enabled(module)))
    )

    actual = loss_and_grads(model, loss, columns, train=True)
    choice = loss.auto_mini_batch.choice
    assert choice.checkpointing and choice.size > 4 and "with gradient checkpointing" in str(choice), choice
    step = passes[-(2 * choice.minibatches - choice.kept) :]  # the kept mini-batches are embedded once
    assert all(on == with_graph for with_graph, on in step), "checkpointing in the graph passes only"
    assert not checkpointing.is_enabled(model)
    assert_same_grads(actual, loss_and_grads(model, upstream.MultipleNegativesRankingLoss(model), columns, train=True))
