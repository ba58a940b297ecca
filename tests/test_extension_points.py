"""Upstream's documented extension points of the cached losses still work after the import swap.

Upstream's cached losses embed each mini-batch through methods a subclass may override
(``embed_minibatch``, ``embed_minibatch_iter``). st_ext's engine never calls them, so a subclass
of st_ext's class that overrides one runs upstream's forward (which does), warns once that st_ext's
engine is bypassed, and refuses ``mini_batch_size="auto"``, which only st_ext's engine can resolve.
A subclass that overrides nothing keeps st_ext's engine.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from loss_checks import assert_same_grads, features_of, loss_and_grads, text_columns
from sentence_transformers import util

from st_ext import losses
from st_ext._compat import st_losses
from st_ext.losses import cached_ranking
from st_ext.losses.overrides import upstream_hook_overrides

upstream = st_losses()
pytestmark = [pytest.mark.conformance, pytest.mark.usefixtures("one_torch_thread")]

RANKING = ["CachedMultipleNegativesRankingLoss", "CachedMultipleNegativesSymmetricRankingLoss"]
BATCH = 4
#: Smaller than the batch: upstream's engine runs several mini-batches per column and replays them.
MINI_BATCH = 2
#: ``embed_minibatch``'s parameters on every supported release (4.1.0 … 6.2.0).
EMBED_MINIBATCH_PARAMETERS = [
    "self",
    "sentence_feature",
    "begin",
    "end",
    "with_grad",
    "copy_random_state",
    "random_state",
]


def doubling_subclass(base: type) -> type:
    """``base`` with an ``embed_minibatch`` that doubles the embeddings and counts its calls.

    The similarity is a dot product in the tests, so doubling changes the loss (a cosine would not).
    A new class per call: the warning is once per class.
    """

    class Doubling(base):
        calls = 0

        def embed_minibatch(self, sentence_feature, begin, end, with_grad, copy_random_state, random_state=None):
            type(self).calls += 1
            reps, random_state = super().embed_minibatch(
                sentence_feature, begin, end, with_grad, copy_random_state, random_state
            )
            return reps * 2, random_state

    return Doubling


def build(cls: type, model, **kwargs):
    return cls(model, similarity_fct=util.dot_score, scale=1.0, mini_batch_size=MINI_BATCH, **kwargs)


def quietly(make):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make()


@pytest.mark.parametrize("name", RANKING)
def test_the_override_has_upstreams_signature(name):
    """The subclasses here override ``embed_minibatch`` exactly as the installed release declares it."""
    parameters = list(inspect.signature(getattr(upstream, name).embed_minibatch).parameters)
    assert parameters == EMBED_MINIBATCH_PARAMETERS


@pytest.mark.parametrize("name", RANKING)
def test_an_embed_minibatch_override_gives_upstreams_loss_and_gradients(model, name):
    ours_class = doubling_subclass(getattr(losses, name))
    theirs_class = doubling_subclass(getattr(upstream, name))
    ours = quietly(lambda: build(ours_class, model))
    theirs = build(theirs_class, model)
    columns = text_columns(BATCH, 2)

    expected = loss_and_grads(model, theirs, columns, train=True)
    actual = loss_and_grads(model, ours, columns, train=True)

    assert ours_class.calls > 0, "the override was never called"
    assert ours_class.calls == theirs_class.calls
    assert_same_grads(actual, expected)
    plain = loss_and_grads(model, build(getattr(losses, name), model), columns, train=True)
    assert not torch.allclose(plain[0], expected[0]), "the override must change the loss, or this test proves nothing"


@pytest.mark.parametrize("name", RANKING)
def test_an_override_warns_once_naming_the_class_and_the_method(model, name):
    ours_class = doubling_subclass(getattr(losses, name))
    columns = text_columns(BATCH, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = build(ours_class, model)
        loss(features_of(model, columns), None).backward()
        loss(features_of(model, columns), None)
        build(ours_class, model)
    messages = [str(warning.message) for warning in caught if "embed_minibatch" in str(warning.message)]
    assert len(messages) == 1, messages
    assert "Doubling" in messages[0]
    assert "bypassed" in messages[0] and "st_ext" in messages[0]
    assert all(issubclass(warning.category, UserWarning) for warning in caught if str(warning.message) in messages)


@pytest.mark.parametrize("name", RANKING)
def test_auto_mini_batch_size_with_an_override_is_refused_at_construction(model, name):
    ours_class = doubling_subclass(getattr(losses, name))
    with pytest.raises(ValueError, match=r"Doubling overrides embed_minibatch.*mini_batch_size a number"):
        ours_class(model, mini_batch_size="auto")
    with pytest.raises(ValueError, match="mini_batch_size a number"):
        ours_class(model, mini_batch_size="auto", memory_budget_mb=100)


@pytest.mark.parametrize("name", RANKING)
def test_a_subclass_without_overrides_keeps_st_exts_engine(model, name, monkeypatch):
    class Plain(getattr(losses, name)):
        def describe(self) -> str:
            return "a subclass that adds a method but overrides no hook"

    engine_calls = []
    engine = cached_ranking.gradcache_forward

    def observed(*args, **kwargs):
        engine_calls.append(args)
        return engine(*args, **kwargs)

    monkeypatch.setattr(cached_ranking, "gradcache_forward", observed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = build(Plain, model)
        value = loss(features_of(model, text_columns(BATCH, 2)), None)
    value.backward()
    assert len(engine_calls) == 1
    assert not [warning for warning in caught if "bypassed" in str(warning.message)]
    assert upstream_hook_overrides(loss, getattr(upstream, name)) == ()
    assert Plain(model, mini_batch_size="auto").mini_batch_size == "auto"


@pytest.mark.parametrize("name", RANKING)
def test_an_embed_minibatch_iter_override_is_honoured_too(model, name, monkeypatch):
    """Every hook of upstream's engine counts, not only ``embed_minibatch``."""

    class Iterating(getattr(losses, name)):
        passes = 0

        def embed_minibatch_iter(self, *args, **kwargs):
            type(self).passes += 1
            yield from super().embed_minibatch_iter(*args, **kwargs)

    monkeypatch.setattr(cached_ranking, "gradcache_forward", None)  # st_ext's engine must not run
    loss = quietly(lambda: build(Iterating, model))
    assert upstream_hook_overrides(loss, getattr(upstream, name)) == ("embed_minibatch_iter",)
    loss(features_of(model, text_columns(BATCH, 2)), None).backward()
    assert Iterating.passes == 4  # two columns, embedded without and then with a graph


def test_an_override_on_st_exts_own_gist_is_refused(model, guide):
    """st_ext's CachedGISTEmbedLoss is its own implementation: upstream's forward cannot run it, so an
    override of upstream's hooks is refused with what to do instead, not silently ignored."""

    class Projecting(losses.CachedGISTEmbedLoss):
        def embed_minibatch(self, sentence_feature, begin, end, with_grad, copy_random_state, random_state=None):
            raise AssertionError("not reached")

    with pytest.raises(ValueError, match=r"Projecting overrides embed_minibatch.*Subclass sentence_transformers'"):
        Projecting(model, guide, mini_batch_size=MINI_BATCH)
    assert upstream_hook_overrides(losses.CachedGISTEmbedLoss(model, guide), upstream.CachedGISTEmbedLoss) == ()


@pytest.mark.parametrize("inner_from", ["st_ext", "upstream"])
def test_an_override_under_matryoshka_is_honoured(model, inner_from):
    """A wrapper that runs the engine itself hands an overriding loss to upstream's wrapper, which calls it."""
    base = (
        losses.CachedMultipleNegativesRankingLoss
        if inner_from == "st_ext"
        else upstream.CachedMultipleNegativesRankingLoss
    )
    ours_class, theirs_class = doubling_subclass(base), doubling_subclass(upstream.CachedMultipleNegativesRankingLoss)
    dims = [32]
    ours = quietly(lambda: losses.MatryoshkaLoss(model, build(ours_class, model), dims))
    theirs = upstream.MatryoshkaLoss(model, build(theirs_class, model), dims)
    columns = text_columns(BATCH, 2)

    expected = loss_and_grads(model, theirs, columns, train=False)
    actual = loss_and_grads(model, ours, columns, train=False)

    assert ours_class.calls == theirs_class.calls > 0
    assert_same_grads(actual, expected)
