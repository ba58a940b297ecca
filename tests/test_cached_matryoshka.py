"""Cached MatryoshkaLoss: upstream's gradients, mini-batch memory, and the wrapped loss left alone."""

from __future__ import annotations

import pytest
import torch
from loss_checks import (
    assert_bounded_by_the_mini_batch,
    assert_losses_agree,
    assert_same_grads,
    features_of,
    grads_differ,
    long_columns,
    loss_and_grads,
    peak_training_bytes,
    text_columns,
)
from torch import nn

from st_ext import losses
from st_ext._compat import st_losses
from st_ext.losses.features import layout_of, slice_rows
from st_ext.losses.minibatches import plan_minibatches

upstream = st_losses()
DIMS = [32, 16, 8]
BATCH = 8


# Dropout off with several mini-batches checks the mini-batching; dropout on with one mini-batch
# checks that the second forward pass replays the first one's dropout masks.
SETTINGS = [pytest.param(False, 3, id="eval-3-minibatches"), pytest.param(True, BATCH, id="dropout-replayed")]


@pytest.mark.parametrize("train, mini_batch_size", SETTINGS)
@pytest.mark.parametrize("num_columns", [2, 3], ids=["pairs", "hard-negatives"])
def test_cached_matches_non_cached_mnrl(model, train, mini_batch_size, num_columns):
    columns = text_columns(BATCH, num_columns)
    reference = upstream.MatryoshkaLoss(model, upstream.MultipleNegativesRankingLoss(model), DIMS)
    cached = losses.MatryoshkaLoss(
        model, upstream.CachedMultipleNegativesRankingLoss(model, mini_batch_size=mini_batch_size), DIMS
    )
    assert_losses_agree(model, cached, reference, columns, train=train)


def test_symmetric_cached_loss_matches_upstream_wrapper(model):
    """Compared with upstream's own cached path: 4.x's cached symmetric loss is not its non-cached one."""
    columns = text_columns(BATCH, 2)

    def wrapped(wrapper):
        inner = upstream.CachedMultipleNegativesSymmetricRankingLoss(model, mini_batch_size=3)
        return wrapper(model, inner, DIMS, [1.0, 0.5, 0.25])

    assert_same_grads(
        loss_and_grads(model, wrapped(losses.MatryoshkaLoss), columns, train=False),
        loss_and_grads(model, wrapped(upstream.MatryoshkaLoss), columns, train=False),
    )


@pytest.mark.parametrize(
    "weights, n_dims_per_step",
    [([1.0, 0.5, 0.25], -1), (None, 2), ([2.0, 1.0, 0.5], 1)],
    ids=["weights", "2-dims", "1-dim-weighted"],
)
def test_weights_and_dims_per_step_match_upstream(model, weights, n_dims_per_step):
    columns = text_columns(BATCH, 2)
    mnrl = upstream.MultipleNegativesRankingLoss(model)
    reference = upstream.MatryoshkaLoss(model, mnrl, DIMS, weights, n_dims_per_step)
    cached = losses.MatryoshkaLoss(
        model, upstream.CachedMultipleNegativesRankingLoss(model, mini_batch_size=3), DIMS, weights, n_dims_per_step
    )
    ours = loss_and_grads(model, cached, columns, train=False)
    assert_same_grads(ours, loss_and_grads(model, reference, columns, train=False))
    everything = losses.MatryoshkaLoss(model, cached.loss, DIMS)
    assert grads_differ(ours, loss_and_grads(model, everything, columns, train=False))


def test_ordinary_loss_is_upstream_behaviour(model):
    columns = text_columns(BATCH, 2)
    reference = upstream.MatryoshkaLoss(model, upstream.MultipleNegativesRankingLoss(model), DIMS)
    ours = losses.MatryoshkaLoss(model, upstream.MultipleNegativesRankingLoss(model), DIMS)
    assert not ours.uses_gradient_cache
    assert_losses_agree(model, ours, reference, columns, train=True)


def test_evaluation_without_grad_gives_the_training_value(model):
    columns = text_columns(BATCH, 2)
    loss = losses.MatryoshkaLoss(model, upstream.CachedMultipleNegativesRankingLoss(model, mini_batch_size=3), DIMS)
    model.eval()
    with torch.no_grad():
        evaluated = loss(features_of(model, columns), None)
    assert not evaluated.requires_grad
    trained, _ = loss_and_grads(model, loss, columns, train=False)
    torch.testing.assert_close(evaluated, trained)


def test_two_forwards_before_backward_keep_their_own_state(model):
    """Everything a backward needs travels with its loss tensor, not on the loss module."""
    first, second = text_columns(BATCH, 2, seed=1), text_columns(BATCH, 2, seed=2)
    loss = losses.MatryoshkaLoss(model, upstream.CachedMultipleNegativesRankingLoss(model, mini_batch_size=3), DIMS)
    model.eval()
    expected = {}
    for columns in (first, second):
        for name, grad in loss_and_grads(model, loss, columns, train=False)[1].items():
            expected[name] = expected.get(name, 0) + grad
    value_first = loss(features_of(model, first), None)
    value_second = loss(features_of(model, second), None)
    (value_first + value_second).backward()
    actual = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert_same_grads((torch.tensor(0.0), actual), (torch.tensor(0.0), expected))


def test_mini_batches_by_rows_or_by_token_budget():
    lengths = [5, 5, 12, 3, 3]
    mask = torch.tensor([[1] * n + [0] * (12 - n) for n in lengths])
    features = {"input_ids": mask.clone(), "attention_mask": mask}
    layout = layout_of(features)
    assert plan_minibatches([features], [layout], 2).column_ranges() == [[(0, 2), (2, 4), (4, 5)]]
    assert plan_minibatches([features], [layout], 2, 10).column_ranges() == [[(0, 2), (2, 3), (3, 5)]]
    assert slice_rows(features, 3, 5, layout)["input_ids"].shape == (2, 3)


# --------------------------------------------------------------------------------------------
# The wrapped loss is left alone


def test_wrapping_twice_or_using_bare_is_unchanged(model):
    columns = text_columns(BATCH, 2)
    inner = upstream.CachedMultipleNegativesRankingLoss(model, mini_batch_size=3)
    bare_before = loss_and_grads(model, inner, columns, train=False)
    once = losses.MatryoshkaLoss(model, inner, DIMS)
    wrapped_once = loss_and_grads(model, once, columns, train=False)
    twice = losses.MatryoshkaLoss(model, inner, DIMS)
    assert "calculate_loss" not in vars(inner)
    assert_same_grads(loss_and_grads(model, twice, columns, train=False), wrapped_once)
    assert_same_grads(loss_and_grads(model, once, columns, train=False), wrapped_once)
    assert_same_grads(loss_and_grads(model, inner, columns, train=False), bare_before)


def test_upstream_matryoshka_mutates_the_wrapped_loss(model):
    """Upstream replaces calculate_loss on the instance: a second wrapper stacks, the bare loss changes."""
    columns = text_columns(BATCH, 2)
    inner = upstream.CachedMultipleNegativesRankingLoss(model, mini_batch_size=3)
    bare_before = loss_and_grads(model, inner, columns, train=False)
    loss_and_grads(model, upstream.MatryoshkaLoss(model, inner, DIMS), columns, train=False)
    assert "calculate_loss" in vars(inner)
    assert grads_differ(loss_and_grads(model, inner, columns, train=False), bare_before)
    twice = upstream.MatryoshkaLoss(model, inner, DIMS)
    with pytest.raises(ValueError, match="cannot be greater than"):  # 32 dims asked of embeddings already cut to 8
        loss_and_grads(model, twice, columns, train=False)
    # st_ext reads the class's calculate_loss, so even an instance upstream decorated is wrapped correctly.
    reference = upstream.MatryoshkaLoss(model, upstream.MultipleNegativesRankingLoss(model), DIMS)
    assert_same_grads(
        loss_and_grads(model, losses.MatryoshkaLoss(model, inner, DIMS), columns, train=False),
        loss_and_grads(model, reference, columns, train=False),
    )


# --------------------------------------------------------------------------------------------
# Memory (CPU, st_ext.memory's profiler meter)


def test_peak_memory_does_not_grow_with_batch_size(deep_model):
    dims = [64, 32, 16]
    cached = losses.MatryoshkaLoss(
        deep_model, upstream.CachedMultipleNegativesRankingLoss(deep_model, mini_batch_size=16), dims
    )
    reference = upstream.MatryoshkaLoss(deep_model, upstream.MultipleNegativesRankingLoss(deep_model), dims)
    assert_bounded_by_the_mini_batch(deep_model, cached, reference)


def test_peak_memory_does_not_grow_with_dimensions(deep_model):
    columns = long_columns(32)

    def peak(dims):
        inner = upstream.CachedMultipleNegativesRankingLoss(deep_model, mini_batch_size=16)
        return peak_training_bytes(deep_model, losses.MatryoshkaLoss(deep_model, inner, dims), columns)

    one, five = peak([64]), peak([64, 48, 32, 16, 8])
    assert five <= 1.25 * one, (one, five)


# --------------------------------------------------------------------------------------------
# Errors (argument checks and warnings are upstream's: tests/test_upstream_conformance.py)


class OpaqueCachedLoss(nn.Module):
    """A loss that defers its backward to a hook, with no loss-over-embeddings st_ext can call."""

    uses_gradient_cache = True

    def __init__(self, model):
        super().__init__()
        self.model = model


def construction_error(build):
    try:
        build()
    except Exception as exception:  # noqa: BLE001 - compared with upstream's
        return type(exception)
    return None


def test_losses_st_ext_cannot_reach_into_are_left_to_upstream(model):
    """Upstream decides (6.x raises for a gradient-caching loss without calculate_loss, 4.x runs it),
    and st_ext does the same rather than adding an error of its own."""
    expected = construction_error(lambda: upstream.MatryoshkaLoss(model, OpaqueCachedLoss(model), DIMS))
    assert construction_error(lambda: losses.MatryoshkaLoss(model, OpaqueCachedLoss(model), DIMS)) is expected
    loss = losses.MatryoshkaLoss(model, upstream.MultipleNegativesRankingLoss(model), DIMS)
    assert not loss.uses_gradient_cache


@pytest.mark.parametrize(
    "inner, error, message",
    [
        (lambda model, other: nn.Linear(2, 2), TypeError, "got Linear, which is not called that way"),
        (lambda model, other: model, TypeError, "got SentenceTransformer, which is not called that way"),
        (lambda model, other: "mnrl", TypeError, "got str"),
        (lambda model, other: upstream.MultipleNegativesRankingLoss(other), ValueError, "built for another model"),
    ],
    ids=["module", "the-model", "a-name", "another-model"],
)
def test_something_that_is_not_a_loss_of_this_model_is_refused(model, guide, inner, error, message):
    """Upstream accepts these and fails (or silently truncates nothing) at the first step."""
    with pytest.raises(error, match=message):
        losses.MatryoshkaLoss(model, inner(model, guide), DIMS)


def test_a_cached_matryoshka_cannot_be_wrapped_again(model):
    nested = losses.MatryoshkaLoss(model, upstream.CachedMultipleNegativesRankingLoss(model), DIMS)
    with pytest.raises(TypeError, match="cannot be wrapped again"):
        losses.MatryoshkaLoss(model, nested, DIMS)


def test_model_card_fields(model):
    loss = losses.MatryoshkaLoss(model, upstream.CachedMultipleNegativesRankingLoss(model), [16, 32], [0.5, 1.0])
    assert loss.get_config_dict() == {
        "loss": "CachedMultipleNegativesRankingLoss",
        "matryoshka_dims": (32, 16),
        "matryoshka_weights": (1.0, 0.5),
        "n_dims_per_step": -1,
    }
    assert "kusupati2024matryoshka" in loss.citation
    assert isinstance(loss, upstream.MatryoshkaLoss)


# --------------------------------------------------------------------------------------------
# Registry


def test_registry_builds_named_losses(model):
    built = losses.build_loss("matryoshka_cached_mnrl", model, mini_batch_size=4, matryoshka_dims=[32, 8])
    assert isinstance(built, losses.MatryoshkaLoss) and built.matryoshka_dims == (32, 8)
    assert isinstance(built.loss, upstream.CachedMultipleNegativesRankingLoss) and built.loss.mini_batch_size == 4
    assert type(losses.build_loss("mnrl", model, scale=10.0)).__name__ == "MultipleNegativesRankingLoss"
    assert losses.build_loss("matryoshka_mnrl", model).matryoshka_dims == (32,)
    assert {"mnrl", "cached_mnrl", "gist", "cached_gist", "matryoshka_cached_mnrl", "matryoshka_cached_gist"} <= set(
        losses.known_losses()
    )


def test_registry_errors(model):
    with pytest.raises(ValueError, match="Unknown loss 'mnrll'. Known losses: angle, .*cached_gist"):
        losses.build_loss("mnrll", model)
    with pytest.raises(ValueError, match="use 'matryoshka_mnrl'"):
        losses.build_loss("mnrl", model, matryoshka_dims=[16])
    with pytest.raises(ValueError, match="needs a guide"):
        losses.build_loss("cached_gist", model)
    with pytest.raises(ValueError, match="takes no guide"):
        losses.build_loss("cached_mnrl", model, guide=model)


def test_every_upstream_loss_name_is_exported():
    assert set(upstream.__all__) <= set(losses.__all__)
    assert losses.MultipleNegativesRankingLoss is upstream.MultipleNegativesRankingLoss
    assert losses.MatryoshkaLoss is not upstream.MatryoshkaLoss
