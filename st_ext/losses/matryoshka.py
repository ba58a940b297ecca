"""Matryoshka over any loss; over cached losses, in mini-batch memory and without touching the wrapped loss.

Upstream's ``MatryoshkaLoss`` replaces ``calculate_loss`` on a wrapped cached instance, so wrapping it
twice stacks the truncations and the instance stays changed. Here the wrapper runs GradCache itself
and only *calls* the wrapped loss over embeddings, once per dimension on truncated copies of the
cached embeddings, carrying each dimension's weighted gradient back to the full embeddings before
the next one's copies are made: memory does not grow with the number of dimensions. Every other
loss runs through upstream's own implementation, its checks and warnings included.
"""

from __future__ import annotations

import inspect
import numbers
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from st_ext._compat import loss_model, st_losses
from st_ext.losses._signatures import PLACEHOLDER_LOSS, named_like_upstream
from st_ext.losses.features import Features, Ranges
from st_ext.losses.gradcache import CachedLoss, LossStep, StartStep, gradcache_forward
from st_ext.losses.loss_descriptions import as_cached_loss, engine_description
from st_ext.losses.loss_functions import LossFn, Reps, Source, weighted_term

if TYPE_CHECKING:  # upstream's losses as 6.x places them; at run time, the installed release's
    from sentence_transformers.sentence_transformer import losses as _upstream
else:
    _upstream = st_losses()


def shrink(embeddings: Tensor, dim: int) -> Tensor:
    """The first ``dim`` coordinates, re-normalised (upstream's truncation, and its error)."""
    if dim > embeddings.shape[-1]:
        raise ValueError(
            f"Dimension {dim} in matryoshka_dims cannot be greater than the model's embedding dimension: "
            f"{embeddings.shape[-1]}"
        )
    return F.normalize(embeddings[..., :dim], p=2, dim=-1)


def dims_for_step(dims: Sequence[int], weights: Sequence[float], n_dims_per_step: int) -> list[tuple[int, float]]:
    """The (dimension, weight) pairs trained this step, drawn from Python's ``random`` as upstream
    draws them, so a seeded run picks the same dimensions."""
    indices: Sequence[int] = range(len(dims))
    if 0 < n_dims_per_step < len(dims):
        indices = sorted(random.sample(indices, n_dims_per_step))
    return [(dims[index], weights[index]) for index in indices]


def matryoshka_loss_from_embeddings(
    loss_fn: LossFn,
    reps: Reps,
    labels: Tensor | None,
    *,
    with_backward: bool,
    dims_weights: Sequence[tuple[int, float]],
) -> Tensor:
    """The weighted sum of the wrapped loss over truncated embeddings: every column is truncated, columns
    a wrapped loss added (a queue of earlier embeddings) included."""
    total = torch.zeros((), device=reps[0][0].device)
    for dim, weight in dims_weights:
        truncated = [[shrink(rep, dim) for rep in column] for column in reps]
        total = total + weighted_term(loss_fn, truncated, labels, weight, with_backward=with_backward)
    return total


_NOTE = (
    "over a cached loss (``CachedMultipleNegativesRankingLoss``, ``CachedMultipleNegativesSymmetricRankingLoss``, "
    "``CachedGISTEmbedLoss``, upstream's or st_ext's; on 5.7+ every loss on upstream's GradCache base such as "
    "``MegaBatchMarginLoss``; any ``CrossBatchMemoryLoss``, whose queue is truncated with the batch), GradCache runs in this wrapper: peak memory does not grow with the number of dimensions, the "
    "wrapped instance is never modified, and ``n_dims_per_step`` is honoured (4.x's upstream ignores it for "
    "cached losses; GradCache: https://huggingface.co/papers/2101.06983). Every other loss runs through upstream's "
    "implementation."
)


@named_like_upstream(_upstream.MatryoshkaLoss, _NOTE)
class MatryoshkaLoss(_upstream.MatryoshkaLoss):
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
        # Over a cached loss, upstream's checks, warning, sorting and attributes, without letting it decorate `loss`.
        inner = PLACEHOLDER_LOSS() if self._on_st_ext_engine else loss
        # Upstream annotates a SentenceTransformer; st_ext takes the model of any loss it can wrap (build_loss's).
        super().__init__(model, inner, matryoshka_dims, matryoshka_weights, n_dims_per_step)  # type: ignore[arg-type]
        self.loss = loss
        # Upstream's own forward reads the uses_gradient_cache it sets (6.x).
        self.uses_gradient_cache = self._on_st_ext_engine or getattr(self, "uses_gradient_cache", False)

    # Over an EmbeddingLossSum the value is its terms by name, where upstream's forward returns one tensor.
    def forward(  # type: ignore[override]
        self, sentence_features: Iterable[Features], labels: Tensor | None = None
    ) -> Tensor | dict[str, Tensor]:
        if not self._on_st_ext_engine:
            # Upstream annotates labels as a tensor, but passes None on to a loss that takes no labels.
            return super().forward(sentence_features, labels)  # type: ignore[arg-type]
        return gradcache_forward(self._engine_loss(), sentence_features, labels)

    def cached_loss(self) -> CachedLoss | None:
        """This loss for the engine (None: upstream's implementation runs it): the wrapped loss, trained at this
        loss's dimensions."""
        return self._engine_loss() if self._on_st_ext_engine else None

    def _engine_loss(self) -> CachedLoss:
        inner = engine_description(self.loss, type(self).__name__)
        return replace(inner, name=type(self).__name__, start=partial(self.start_step, inner.start))

    def start_step(
        self, inner_start: StartStep, sentence_features: list[Features], ranges: list[Ranges], mini_batch_size: int
    ) -> LossStep:
        """The wrapped loss's step (``inner_start``'s), with the loss function of each output at this loss's
        dimensions."""
        step = inner_start(sentence_features, ranges, mini_batch_size)
        return replace(step, loss_for=partial(self.loss_at_dimensions, step.loss_for))

    def loss_at_dimensions(self, inner_loss_for: Callable[[Source], LossFn], source: Source) -> LossFn:
        """The wrapped loss function of ``source``'s output at the dimensions drawn for this call (per layer,
        under a layer-wise loss)."""
        dims_weights = dims_for_step(self.matryoshka_dims, self.matryoshka_weights, self.n_dims_per_step)
        return partial(matryoshka_loss_from_embeddings, inner_loss_for(source), dims_weights=dims_weights)


def _check_inner_loss(model: nn.Module, loss: Any) -> None:
    """Refuse at construction what would fail (or silently not truncate) at the first step."""
    forward = getattr(loss, "forward", None)
    callable_as_loss = False
    if forward is not None:
        try:
            inspect.signature(forward).bind(object(), object())
            callable_as_loss = isinstance(loss, nn.Module)
        except (TypeError, ValueError):
            pass
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
    """Upstream accepts a dimension that is not a whole number and fails at the first step, when the
    embeddings are sliced (zero, negative and too large ones it refuses itself)."""
    for index, dim in enumerate(dims):
        if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
            raise ValueError(
                f"matryoshka_dims must be integers, got {dim!r} at position {index}; "
                "pass whole numbers of embedding dimensions, e.g. [768, 512, 256]."
            )


def _refuse_nested_cached(loss: nn.Module) -> None:
    if isinstance(loss, MatryoshkaLoss) and loss.uses_gradient_cache:
        raise TypeError(
            "A MatryoshkaLoss over a cached loss cannot be wrapped again: its gradients are computed in its "
            "own backward pass, which an outer MatryoshkaLoss cannot truncate. Give one MatryoshkaLoss all "
            "the dimensions instead."
        )
