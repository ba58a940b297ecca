"""Layer-wise GradCache: AdaptiveLayerLoss and Matryoshka2dLoss over cached losses.

Values and gradients equal upstream's non-cached wrappers (same sampled layers and dimensions,
drawn from the same seed), the replay re-embeds every layer bit for bit, memory is bounded by the
mini-batch, and the layers trained are the ones a truncated model computes.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from loss_checks import (
    assert_bounded_by_the_mini_batch,
    assert_losses_agree,
    assert_same_grads,
    features_of,
    grads_differ,
    guide_from,
    long_columns,
    loss_and_grads,
    peak_training_bytes,
    text_columns,
)

from st_ext import losses
from st_ext._compat import AdaptiveLayerRules, st_losses
from st_ext.losses.features import layout_of
from st_ext.losses.layer_embeddings import LayerEmbeddings
from st_ext.losses.minibatches import plan_minibatches

upstream = st_losses()
BATCH = 8
DIMS = [32, 16, 8]
HAS_LAYER_WEIGHTING = "layer_weighting" in inspect.signature(upstream.AdaptiveLayerLoss.__init__).parameters

# Dropout off with several mini-batches checks the caching of every layer; dropout on with one
# mini-batch checks that every layer comes from the same forward pass as the final one.
SETTINGS = [pytest.param(False, 3, id="eval-3-minibatches"), pytest.param(True, BATCH, id="dropout")]


@pytest.fixture(scope="module")
def guide4(guide_dir):
    return guide_from(guide_dir)


def wrapper_options():
    options = {
        "one-layer": dict(n_layers_per_step=1),
        "all-layers": dict(n_layers_per_step=-1, last_layer_weight=2.0, prior_layers_weight=0.5),
        "no-kl": dict(n_layers_per_step=2, kl_temperature=0.0),
        "kl-weighted": dict(n_layers_per_step=2, kl_temperature=0.5, kl_div_weight=3.0),
    }
    if HAS_LAYER_WEIGHTING:
        options["log-weighting"] = dict(n_layers_per_step=-1, layer_weighting="log")
    return options


INNER = {
    # name: (st_ext's cached inner, upstream's non-cached reference inner, number of columns)
    "mnrl": (
        lambda m, g, size: losses.CachedMultipleNegativesRankingLoss(m, mini_batch_size=size),
        lambda m, g: upstream.MultipleNegativesRankingLoss(m),
        2,
    ),
    "mnrl-hard-negatives": (
        lambda m, g, size: upstream.CachedMultipleNegativesRankingLoss(m, mini_batch_size=size),
        lambda m, g: upstream.MultipleNegativesRankingLoss(m),
        3,
    ),
    "gist": (
        lambda m, g, size: losses.CachedGISTEmbedLoss(m, g, mini_batch_size=size),
        lambda m, g: upstream.GISTEmbedLoss(m, g),
        2,
    ),
}


@pytest.mark.parametrize("train, mini_batch_size", SETTINGS)
@pytest.mark.parametrize("inner", list(INNER))
@pytest.mark.parametrize("options", list(wrapper_options()))
def test_adaptive_layers_match_upstream_non_cached(model4, guide4, train, mini_batch_size, inner, options):
    cached_inner, reference_inner, num_columns = INNER[inner]
    kwargs = wrapper_options()[options]
    columns = text_columns(BATCH, num_columns)
    ours = losses.AdaptiveLayerLoss(model4, cached_inner(model4, guide4, mini_batch_size), **kwargs)
    reference = upstream.AdaptiveLayerLoss(model4, reference_inner(model4, guide4), **kwargs)
    assert ours.uses_gradient_cache
    assert_losses_agree(model4, ours, reference, columns, train=train)


@pytest.mark.parametrize("train, mini_batch_size", SETTINGS)
@pytest.mark.parametrize("inner", ["mnrl", "gist"])
@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(n_layers_per_step=-1, n_dims_per_step=-1, matryoshka_weights=[1.0, 0.5, 0.25])],
    ids=["sampled", "everything-weighted"],
)
def test_matryoshka_2d_matches_upstream_non_cached(model4, guide4, train, mini_batch_size, inner, kwargs):
    cached_inner, reference_inner, num_columns = INNER[inner]
    columns = text_columns(BATCH, num_columns)
    ours = losses.Matryoshka2dLoss(model4, cached_inner(model4, guide4, mini_batch_size), DIMS, **kwargs)
    reference = upstream.Matryoshka2dLoss(model4, reference_inner(model4, guide4), DIMS, **kwargs)
    assert ours.uses_gradient_cache
    assert_losses_agree(model4, ours, reference, columns, train=train)


def test_draws_follow_the_seed(model4):
    """Layers and dimensions are drawn from Python's ``random``: another seed trains other ones."""
    columns = text_columns(BATCH, 2)
    loss = losses.Matryoshka2dLoss(model4, losses.CachedMultipleNegativesRankingLoss(model4, mini_batch_size=3), DIMS)
    first = loss_and_grads(model4, loss, columns, train=False, seed=1)
    assert_same_grads(first, loss_and_grads(model4, loss, columns, train=False, seed=1))
    assert any(
        grads_differ(first, loss_and_grads(model4, loss, columns, train=False, seed=seed)) for seed in (2, 3, 4)
    )


def test_symmetric_cached_loss_matches_upstream_non_cached(model4):
    columns = text_columns(BATCH, 2)
    cached_inner = losses.CachedMultipleNegativesSymmetricRankingLoss(model4, mini_batch_size=3)
    plain_inner = upstream.MultipleNegativesSymmetricRankingLoss(model4)
    try:
        assert_losses_agree(model4, cached_inner, plain_inner, columns, train=False)
    except AssertionError:
        pytest.skip("this release's cached symmetric loss ranks documents per mini-batch: not its non-cached one")
    ours = losses.Matryoshka2dLoss(model4, cached_inner, DIMS, n_layers_per_step=2)
    reference = upstream.Matryoshka2dLoss(model4, plain_inner, DIMS, n_layers_per_step=2)
    assert_losses_agree(model4, ours, reference, columns, train=False)


@pytest.mark.parametrize("budget", [None, 40.0], ids=["no-budget", "budget"])
def test_auto_mini_batches_under_a_layer_wise_loss(model4, budget):
    """``mini_batch_size="auto"`` sizes the mini-batches of the wrapped loss; the values stay upstream's."""
    columns = text_columns(BATCH, 2, min_words=10, max_words=16)
    inner = losses.CachedMultipleNegativesRankingLoss(model4, mini_batch_size="auto", memory_budget_mb=budget)
    ours = losses.Matryoshka2dLoss(model4, inner, DIMS, n_layers_per_step=-1)
    reference = upstream.Matryoshka2dLoss(
        model4, upstream.MultipleNegativesRankingLoss(model4), DIMS, n_layers_per_step=-1
    )
    assert_losses_agree(model4, ours, reference, columns, train=False)
    assert inner.auto_mini_batch.choice is not None


def test_plain_losses_run_upstreams_implementation(model4):
    columns = text_columns(BATCH, 2)
    ours = losses.Matryoshka2dLoss(model4, upstream.MultipleNegativesRankingLoss(model4), DIMS)
    reference = upstream.Matryoshka2dLoss(model4, upstream.MultipleNegativesRankingLoss(model4), DIMS)
    assert not ours.uses_gradient_cache
    assert_losses_agree(model4, ours, reference, columns, train=True)


def test_replay_re_embeds_every_layer_bit_for_bit_with_dropout(model4):
    """Step (3) re-embeds each mini-batch's layers exactly as step (1) did: the cached gradients belong to them."""
    first_pass, replay = [], []
    model4[1].register_forward_hook(
        lambda module, args, output: (replay if torch.is_grad_enabled() else first_pass).append(
            output["sentence_embedding"].detach().clone()
        )
    )
    loss = losses.AdaptiveLayerLoss(
        model4, losses.CachedMultipleNegativesRankingLoss(model4, mini_batch_size=3), n_layers_per_step=-1
    )
    model4.train()
    features = features_of(model4, text_columns(BATCH, 2))
    # 16 rows in mini-batches of 3; one straddling the two columns is split where they would pad each other.
    passes = len(plan_minibatches(features, [layout_of(f) for f in features], 3).minibatches)
    torch.manual_seed(0)
    value = loss(features, None)
    torch.manual_seed(1234)
    value.backward()
    # the final layer, and every hidden state upstream samples from (all but the last)
    layers = len(model4[0].auto_model.encoder.layer) + 1 - AdaptiveLayerRules.first_hidden_state
    assert len(first_pass) == len(replay) == passes * layers
    for index, (embedded, replayed) in enumerate(zip(first_pass, replay)):
        assert torch.equal(embedded, replayed), f"pooled output {index} was re-embedded differently"
    assert not torch.equal(first_pass[0], first_pass[1]), "layers differ"


def test_trained_layers_are_what_a_truncated_model_computes(model4):
    """Upstream's way of using fewer layers (dropping the encoder's last layers) computes the embedding the
    loss trained for that layer; ``truncate_dim`` then keeps its first coordinates."""
    model4.eval()
    features = features_of(model4, text_columns(4, 1))[0]
    with torch.no_grad():
        outputs = LayerEmbeddings(lambda num_hidden_states: [1, 2])(model4, dict(features))
    for layer, embedding in zip([1, 2], outputs[1:]):
        truncated = copy.deepcopy(model4)
        truncated[0].auto_model.encoder.layer = truncated[0].auto_model.encoder.layer[:layer]
        with torch.no_grad():
            expected = truncated(dict(features))["sentence_embedding"]
        torch.testing.assert_close(embedding, expected)
        truncated.truncate_dim = 8
        encoded = truncated.encode(text_columns(4, 1)[0], convert_to_tensor=True)
        torch.testing.assert_close(encoded, expected[:, :8], atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------------------------
# Memory


def test_peak_memory_is_bounded_by_the_mini_batch(deep_model):
    dims = [64, 32, 16]
    cached = losses.Matryoshka2dLoss(
        deep_model, losses.CachedMultipleNegativesRankingLoss(deep_model, mini_batch_size=16), dims
    )
    reference = upstream.Matryoshka2dLoss(deep_model, upstream.MultipleNegativesRankingLoss(deep_model), dims)
    assert_bounded_by_the_mini_batch(deep_model, cached, reference)


def test_peak_memory_does_not_grow_with_the_layers_used(deep_model):
    columns = long_columns(64)

    def peak(n_layers_per_step):
        inner = losses.CachedMultipleNegativesRankingLoss(deep_model, mini_batch_size=16)
        loss = losses.Matryoshka2dLoss(deep_model, inner, [64, 32, 16], n_layers_per_step=n_layers_per_step)
        return peak_training_bytes(deep_model, loss, columns)

    one, every = peak(1), peak(-1)
    assert every <= 1.25 * one, (one, every)


# --------------------------------------------------------------------------------------------
# Errors


def test_a_cached_layer_wise_loss_cannot_be_wrapped(model4):
    inner = losses.CachedMultipleNegativesRankingLoss(model4, mini_batch_size=4)
    with pytest.raises(TypeError, match=r"cannot be wrapped.*Matryoshka2dLoss"):
        losses.MatryoshkaLoss(model4, losses.AdaptiveLayerLoss(model4, inner), DIMS)
