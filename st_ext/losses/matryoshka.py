"""Matryoshka over any loss; over cached losses, in mini-batch memory and without touching the wrapped loss.

Upstream's ``MatryoshkaLoss`` handles a cached loss by replacing ``calculate_loss`` on the wrapped
instance, so wrapping one instance twice stacks the truncations, and the instance stays changed for
anyone who uses it afterwards. Here the wrapper runs GradCache itself (:mod:`st_ext.losses.gradcache`)
and only *calls* the wrapped loss's loss-over-embeddings:

    (1) embed every mini-batch once, without a graph (the guide too, for GIST, never truncated);
    (2) for each Matryoshka dimension in turn, truncate and re-normalise the cached embeddings, let
        the wrapped loss back-propagate to them, and carry the weighted gradient back to the full
        embeddings; only one dimension's truncated copies exist at a time;
    (3) on ``loss.backward()``, re-embed each mini-batch with a graph and back-propagate the summed
        gradient of all dimensions through it, one mini-batch at a time.

Peak memory is one mini-batch's graph plus embedding-sized buffers: independent of the number of
dimensions, and of the batch size apart from the embeddings themselves.

Every other loss runs through upstream's own implementation, unchanged, and so do the argument
checks and warnings of the installed release: a swapped import behaves as upstream wherever st_ext
adds nothing. ``Matryoshka2dLoss`` and ``AdaptiveLayerLoss`` over a cached loss run GradCache over
layers (:mod:`st_ext.losses.adaptive_layer`), drawing each layer's dimensions here.
"""

from __future__ import annotations

import inspect
import numbers
import random
from collections.abc import Iterable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from st_ext._compat import loss_model, st_losses
from st_ext.losses._signatures import PLACEHOLDER_LOSS, named_like_upstream
from st_ext.losses.cached_loss import (
    CachedLoss,
    LossStep,
    as_cached_loss,
    register_cached_loss,
    with_loss,
)
from st_ext.losses.gradcache import Features, LossFn, Reps, gradcache_forward, weighted_term

_upstream = st_losses()


# ---------------------------------------------------------------------------------------------
# Dimensions


def shrink(embeddings: Tensor, dim: int) -> Tensor:
    """The first ``dim`` coordinates, re-normalised (upstream's truncation, and its error)."""
    if dim > embeddings.shape[-1]:
        raise ValueError(
            f"Dimension {dim} in matryoshka_dims cannot be greater than the model's embedding dimension: "
            f"{embeddings.shape[-1]}"
        )
    return F.normalize(embeddings[..., :dim], p=2, dim=-1)


def dims_for_step(dims: Sequence[int], weights: Sequence[float], n_dims_per_step: int) -> list[tuple[int, float]]:
    """The (dimension, weight) pairs trained this step: all, or a random ``n_dims_per_step`` of them.

    Draws from Python's ``random`` exactly as upstream does, so a seeded run picks the same dimensions.
    """
    indices = range(len(dims))
    if 0 < n_dims_per_step < len(dims):
        indices = sorted(random.sample(indices, n_dims_per_step))
    return [(dims[index], weights[index]) for index in indices]


def matryoshka_loss_from_embeddings(
    loss_fn: LossFn,
    reps: Reps,
    frozen: Reps | None,
    labels: Tensor | None,
    *,
    with_backward: bool,
    dims_weights: Sequence[tuple[int, float]],
    embedding_map=None,
) -> Tensor:
    """Step (2) for every dimension: the weighted sum of the wrapped loss over truncated embeddings.

    With ``with_backward``, each dimension's gradient is carried through the truncation into
    ``reps[..].grad`` before the next dimension's truncated copies are made, and the total is detached.
    The wrapped loss is told the truncation (``embedding_map``), for embeddings it holds itself.
    """
    total = torch.zeros((), device=reps[0][0].device)
    for dim, weight in dims_weights:
        truncated = [[shrink(rep, dim) for rep in column] for column in reps]
        truncation = partial(_then, partial(shrink, dim=dim), embedding_map)
        total = total + weighted_term(
            loss_fn, truncated, frozen, labels, weight, with_backward=with_backward, embedding_map=truncation
        )
    return total


def _then(second, first, embeddings: Tensor) -> Tensor:
    return second(embeddings if first is None else first(embeddings))


def matryoshka(description: CachedLoss, wrapper: MatryoshkaLoss) -> CachedLoss:
    """``description`` trained at ``wrapper``'s dimensions: each call of its loss over embeddings (each
    layer's, under a layer-wise loss) draws the dimensions as upstream does and sums over truncations."""

    def over_dimensions(step: LossStep, sentence_features: list[Features], mini_batch_size: int) -> LossStep:
        def draw(layer):
            dims_weights = dims_for_step(wrapper.matryoshka_dims, wrapper.matryoshka_weights, wrapper.n_dims_per_step)
            return partial(matryoshka_loss_from_embeddings, step.draw(layer), dims_weights=dims_weights)

        return replace(step, draw=draw)

    return with_loss(description, type(wrapper).__name__, over_dimensions)


# ---------------------------------------------------------------------------------------------
# The losses


@named_like_upstream(_upstream.MatryoshkaLoss)
class MatryoshkaLoss(_upstream.MatryoshkaLoss):
    """Train a loss at several embedding sizes at once, so that truncated embeddings still work.

    Upstream's ``MatryoshkaLoss``, with the same arguments, checks, warnings, values and model
    card, except that a cached loss runs in mini-batch memory and is never modified. The wrapped
    loss is computed on the embeddings truncated to each of ``matryoshka_dims`` (and
    re-normalised), and the weighted sum is returned.

    * Cached losses (``CachedMultipleNegativesRankingLoss``, ``CachedMultipleNegativesSymmetricRankingLoss``,
      ``CachedGISTEmbedLoss``, upstream's or st_ext's, and on 5.7+ every loss built on upstream's
      GradCache base such as ``MegaBatchMarginLoss``; every loss registered in
      :mod:`st_ext.losses.cached_loss`): GradCache runs here (see the module
      docstring). ``CrossBatchMemoryLoss`` over a cached ranking loss too: its queue of full-size
      embeddings is truncated and re-normalised with the batch at every dimension. Peak memory
      does not grow with the number of dimensions; the wrapped instance can be wrapped again or
      used bare; ``n_dims_per_step`` is honoured (4.x's upstream ignores it for cached losses).
    * Every other loss: upstream's implementation, unchanged.

    Args:
        model: the SentenceTransformer being trained.
        loss: the loss to compute at every dimension, e.g. ``MultipleNegativesRankingLoss``,
            ``CachedMultipleNegativesRankingLoss``, ``CoSENTLoss``, ``GISTEmbedLoss``.
        matryoshka_dims: the embedding sizes to train, e.g. ``[768, 512, 256, 128, 64]``. Include
            the model's full size (upstream 5.x+ logs a warning otherwise).
        matryoshka_weights: one weight per dimension; None weighs every dimension 1.
        n_dims_per_step: how many randomly drawn dimensions to train per step; -1 (or any value
            that is not between 0 and the number of dimensions) trains all of them.

    References:
        - Matryoshka Representation Learning: https://huggingface.co/papers/2205.13147
        - GradCache, for the cached losses: https://huggingface.co/papers/2101.06983

    Inputs:
        +---------------------------------+---------------------------------+
        | Texts                           | Labels                          |
        +=================================+=================================+
        | whatever the wrapped loss takes | whatever the wrapped loss takes |
        +---------------------------------+---------------------------------+

    Example:
        ::

            from datasets import Dataset
            from st_ext import SentenceTransformer, SentenceTransformerTrainer, losses

            model = SentenceTransformer("sentence-transformers/all-MiniLM-L6-v2")
            train_dataset = Dataset.from_dict({
                "anchor": ["It's nice weather outside today.", "He drove to work."],
                "positive": ["It's so sunny.", "He took the car to the office."],
            })
            inner = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=16)
            loss = losses.MatryoshkaLoss(model, inner, [384, 256, 128, 64])
            SentenceTransformerTrainer(model=model, train_dataset=train_dataset, loss=loss).train()
    """

    def __init__(
        self,
        model: nn.Module,
        loss: nn.Module,
        matryoshka_dims: Sequence[int],
        matryoshka_weights: Sequence[float] | Sequence[int] | None = None,
        n_dims_per_step: int = -1,
    ) -> None:
        _check_inner_loss(model, loss)
        _check_dims(matryoshka_dims)
        _refuse_nested_cached(loss)
        self._on_st_ext_engine = as_cached_loss(loss) is not None
        if not self._on_st_ext_engine:
            # Upstream's wrapper, whole: its own forward reads the uses_gradient_cache it sets (6.x).
            super().__init__(model, loss, matryoshka_dims, matryoshka_weights, n_dims_per_step)
            self.uses_gradient_cache = getattr(self, "uses_gradient_cache", False)
        else:
            # Upstream's checks, warning, sorting and attributes, without letting it decorate `loss`.
            super().__init__(model, PLACEHOLDER_LOSS(), matryoshka_dims, matryoshka_weights, n_dims_per_step)
            self.loss = loss
            self.uses_gradient_cache = True

    def forward(self, sentence_features: Iterable[Features], labels: Tensor | None = None) -> Tensor:
        if not self._on_st_ext_engine:
            return super().forward(sentence_features, labels)
        return gradcache_forward(self.cached_loss(), sentence_features, labels)

    def cached_loss(self) -> CachedLoss | None:
        """This loss for the engine (None: it runs through upstream's implementation)."""
        return matryoshka(as_cached_loss(self.loss), self) if self._on_st_ext_engine else None


def _check_inner_loss(model: nn.Module, loss: Any) -> None:
    """Refuse at construction what would fail (or silently not truncate) at the first step: something
    that is not called as a loss, or a loss that embeds with another model than the one truncated."""
    forward = getattr(loss, "forward", None)
    try:
        inspect.signature(forward).bind(object(), object())
        callable_as_loss = isinstance(loss, nn.Module)
    except (TypeError, ValueError):
        callable_as_loss = False
    if not callable_as_loss:
        raise TypeError(
            f"MatryoshkaLoss wraps a loss called as loss(sentence_features, labels), such as "
            f"MultipleNegativesRankingLoss(model); got {type(loss).__name__}, which is not called that way."
        )
    inner_model = loss_model(loss)
    if isinstance(inner_model, nn.Module) and inner_model is not model:
        raise ValueError(
            f"The wrapped {type(loss).__name__} was built for another model than the one MatryoshkaLoss truncates; "
            "build both with the same model."
        )


def _check_dims(dims: Sequence[int]) -> None:
    """Refuse at construction a dimension that is not a whole number: upstream accepts it and fails at the
    first step, when the embeddings are sliced (zero, negative and too large ones upstream refuses itself)."""
    for index, dim in enumerate(dims):
        if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
            raise ValueError(
                f"matryoshka_dims must be integers, got {dim!r} at position {index}; "
                "pass whole numbers of embedding dimensions, e.g. [768, 512, 256]."
            )


def _refuse_nested_cached(loss: nn.Module) -> None:
    """A MatryoshkaLoss over a cached loss is not wrapped in another: give one all the dimensions."""
    if isinstance(loss, MatryoshkaLoss) and loss.uses_gradient_cache:
        raise TypeError(
            "A MatryoshkaLoss over a cached loss cannot be wrapped again: its gradients are computed in its "
            "own backward pass, which an outer MatryoshkaLoss cannot truncate. Give one MatryoshkaLoss all "
            "the dimensions instead."
        )


register_cached_loss(MatryoshkaLoss, lambda loss: loss.cached_loss())
