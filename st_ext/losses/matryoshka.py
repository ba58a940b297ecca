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
"""

from __future__ import annotations

import numbers
import random
from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from st_ext._compat import embedding_dimension, st_losses
from st_ext._compat import is_gradient_caching
from st_ext.losses.gist import CachedGISTEmbedLoss, guide_pass
from st_ext.losses.gradcache import CachedLoss, Features, LossFn, Ranges, Reps, gradcache_forward

_upstream = st_losses()

MATRYOSHKA_CITATION = """
@misc{kusupati2024matryoshka,
    title={Matryoshka Representation Learning},
    author={Aditya Kusupati and Gantavya Bhatt and Aniket Rege and Matthew Wallingford and Aditya Sinha and Vivek Ramanujan and William Howard-Snyder and Kaifeng Chen and Sham Kakade and Prateek Jain and Ali Farhadi},
    year={2024},
    eprint={2205.13147},
    archivePrefix={arXiv},
    primaryClass={cs.LG}
}
"""


# ---------------------------------------------------------------------------------------------
# Upstream cached losses, seen through the CachedLoss protocol (read-only: nothing is set on them)


class UpstreamCachedLoss:
    """An upstream ``CachedMultipleNegatives(Symmetric)RankingLoss`` as a :class:`CachedLoss`.

    Calls the class's ``calculate_loss``, not the instance's, so an instance that upstream's
    ``MatryoshkaLoss`` already decorated is not truncated a second time.
    """

    def __init__(self, loss: nn.Module) -> None:
        self.loss = loss

    @property
    def model(self) -> nn.Module:
        return self.loss.model

    @property
    def mini_batch_size(self) -> int:
        return self.loss.mini_batch_size

    @property
    def mini_batch_num_tokens(self) -> int | None:
        return getattr(self.loss, "mini_batch_num_tokens", None)

    @property
    def show_progress_bar(self) -> bool:
        return getattr(self.loss, "show_progress_bar", False)

    def frozen_embeddings(self, sentence_features: list[Features], ranges: list[Ranges]) -> Reps | None:
        return None

    def loss_from_embeddings(
        self, reps: Reps, frozen: Reps | None, labels: Tensor | None, *, with_backward: bool
    ) -> Tensor:
        return type(self.loss).calculate_loss(self.loss, reps, with_backward=with_backward)


class UpstreamCachedGIST(UpstreamCachedLoss):
    """An upstream ``CachedGISTEmbedLoss`` as a :class:`CachedLoss`: its guide runs once, in step (1)."""

    def frozen_embeddings(self, sentence_features: list[Features], ranges: list[Ranges]) -> Reps:
        retokenize_with = self.loss.tokenizer if self.loss.must_retokenize else None
        return guide_pass(
            self.loss.guide, sentence_features, ranges, retokenize_with, show_progress_bar=self.show_progress_bar
        )

    def loss_from_embeddings(
        self, reps: Reps, frozen: Reps | None, labels: Tensor | None, *, with_backward: bool
    ) -> Tensor:
        return type(self.loss).calculate_loss(self.loss, reps, frozen, with_backward=with_backward)


def cached_loss_view(loss: nn.Module) -> CachedLoss | None:
    """``loss`` as a :class:`CachedLoss` if it caches gradients, None if it is an ordinary loss.

    Raises for a gradient-caching loss whose loss-over-embeddings st_ext cannot reach.
    """
    if isinstance(loss, CachedGISTEmbedLoss):
        return loss
    if isinstance(loss, _upstream.CachedGISTEmbedLoss):
        return UpstreamCachedGIST(loss)
    ranking = tuple(
        getattr(_upstream, name)
        for name in ("CachedMultipleNegativesRankingLoss", "CachedMultipleNegativesSymmetricRankingLoss")
        if hasattr(_upstream, name)
    )
    if isinstance(loss, ranking):
        return UpstreamCachedLoss(loss)
    if is_gradient_caching(loss):
        raise TypeError(
            f"MatryoshkaLoss cannot wrap {type(loss).__name__}: it runs its own backward passes "
            "(gradient caching), so truncating its forward outputs would not reach its gradients, and st_ext "
            "has no access to its loss over cached embeddings. Supported cached losses: "
            "CachedMultipleNegativesRankingLoss, CachedMultipleNegativesSymmetricRankingLoss, CachedGISTEmbedLoss "
            "(upstream's or st_ext's). A MatryoshkaLoss over a cached loss cannot be wrapped again."
        )
    return None


# ---------------------------------------------------------------------------------------------
# Dimensions


def shrink(embeddings: Tensor, dim: int) -> Tensor:
    """The first ``dim`` coordinates, re-normalised (upstream's truncation)."""
    if dim > embeddings.shape[-1]:
        raise ValueError(
            f"Matryoshka dimension {dim} is larger than the model's embedding dimension {embeddings.shape[-1]}."
        )
    return F.normalize(embeddings[..., :dim], p=2, dim=-1)


def validate_matryoshka(
    matryoshka_dims: Sequence[int],
    matryoshka_weights: Sequence[float] | None,
    n_dims_per_step: int,
    embedding_dim: int | None,
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Checked dimensions and weights, sorted by dimension, largest first (as upstream sorts them)."""
    dims = list(matryoshka_dims) if matryoshka_dims is not None else []
    if not dims:
        raise ValueError("matryoshka_dims must hold at least one dimension.")
    bad = [dim for dim in dims if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim <= 0]
    if bad:
        raise ValueError(f"matryoshka_dims must be positive integers; got {bad} in {dims}.")
    if embedding_dim is not None and max(dims) > embedding_dim:
        raise ValueError(
            f"matryoshka_dims {dims} include dimensions above the model's embedding dimension {embedding_dim}."
        )
    weights = [1] * len(dims) if matryoshka_weights is None else list(matryoshka_weights)
    if len(weights) != len(dims):
        raise ValueError(
            f"matryoshka_weights has {len(weights)} value(s) for {len(dims)} matryoshka_dims; "
            "give one weight per dimension."
        )
    if any(isinstance(w, bool) or not isinstance(w, numbers.Real) for w in weights):
        raise ValueError(f"matryoshka_weights must be numbers, got {weights}.")
    if isinstance(n_dims_per_step, bool) or not isinstance(n_dims_per_step, int) or not (
        n_dims_per_step == -1 or n_dims_per_step > 0
    ):
        raise ValueError(
            f"n_dims_per_step must be -1 (every dimension) or a positive integer, got {n_dims_per_step!r}."
        )
    pairs = sorted(zip((int(d) for d in dims), weights), key=lambda pair: pair[0], reverse=True)
    return tuple(d for d, _ in pairs), tuple(w for _, w in pairs)


def dims_for_step(dims: Sequence[int], weights: Sequence[float], n_dims_per_step: int) -> list[tuple[int, float]]:
    """The (dimension, weight) pairs trained this step: all, or a random ``n_dims_per_step`` of them.

    Draws from Python's ``random`` exactly as upstream does, so a seeded run picks the same dimensions.
    """
    indices = range(len(dims))
    if 0 < n_dims_per_step < len(dims):
        indices = sorted(random.sample(indices, n_dims_per_step))
    return [(dims[index], weights[index]) for index in indices]


def declared_dimension(model: nn.Module) -> int | None:
    """The model's output dimension when it declares one (through DDP/compile wrappers too)."""
    return embedding_dimension(getattr(model, "module", getattr(model, "_orig_mod", model)))


def matryoshka_loss_from_embeddings(
    loss_fn: LossFn,
    reps: Reps,
    frozen: Reps | None,
    labels: Tensor | None,
    *,
    with_backward: bool,
    dims_weights: Sequence[tuple[int, float]],
) -> Tensor:
    """Step (2) for every dimension: the weighted sum of the wrapped loss over truncated embeddings.

    With ``with_backward``, each dimension's gradient is carried through the truncation into
    ``reps[..].grad`` before the next dimension's truncated copies are made, and the total is detached.
    """
    total = torch.zeros((), device=reps[0][0].device)
    for dim, weight in dims_weights:
        truncated = [[shrink(rep, dim) for rep in column] for column in reps]
        if not with_backward:
            total = total + weight * loss_fn(truncated, frozen, labels, with_backward=False)
            continue
        leaves = [[rep.detach().requires_grad_() for rep in column] for column in truncated]
        value = loss_fn(leaves, frozen, labels, with_backward=True)
        pairs = [
            (out, leaf.grad * weight)
            for out_column, leaf_column in zip(truncated, leaves)
            for out, leaf in zip(out_column, leaf_column)
            if leaf.grad is not None
        ]
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
        total = total + weight * value.detach()
    return total


# ---------------------------------------------------------------------------------------------
# The losses


class MatryoshkaLoss(_upstream.MatryoshkaLoss):
    """Upstream's ``MatryoshkaLoss`` (same arguments), cached losses handled in mini-batch memory.

    * Ordinary losses: upstream's implementation, unchanged.
    * Cached losses (``CachedMultipleNegativesRankingLoss``, ``CachedMultipleNegativesSymmetricRankingLoss``,
      ``CachedGISTEmbedLoss``, upstream's or st_ext's): GradCache run here, see the module docstring.
      The wrapped instance is never modified, so it can be wrapped again or used bare.

    A subclass of upstream's class (for ``isinstance`` checks such as the model card's) whose
    constructor is not called: upstream's would decorate a cached loss in place.
    """

    def __init__(
        self,
        model: nn.Module,
        loss: nn.Module,
        matryoshka_dims: Sequence[int],
        matryoshka_weights: Sequence[float] | None = None,
        n_dims_per_step: int = -1,
    ) -> None:
        nn.Module.__init__(self)
        if not isinstance(loss, nn.Module):
            raise TypeError(f"MatryoshkaLoss wraps a loss module, got {type(loss).__name__}.")
        self.matryoshka_dims, self.matryoshka_weights = validate_matryoshka(
            matryoshka_dims, matryoshka_weights, n_dims_per_step, declared_dimension(model)
        )
        self.n_dims_per_step = n_dims_per_step
        self.model = model
        self.loss = loss
        self.uses_gradient_cache = cached_loss_view(loss) is not None
        if not self.uses_gradient_cache:
            # Upstream's wrapper for ordinary losses, kept out of the module tree; it does not modify `loss`.
            plain = _upstream.MatryoshkaLoss(
                model, loss, list(self.matryoshka_dims), list(self.matryoshka_weights), n_dims_per_step
            )
            object.__setattr__(self, "_plain", plain)

    def forward(self, sentence_features: Iterable[Features], labels: Tensor | None = None) -> Tensor:
        view = cached_loss_view(self.loss)
        if view is None:
            # The trainer may have swapped in a wrapped (DDP, compiled) model since construction.
            self._plain.model, self._plain.loss = self.model, self.loss
            return self._plain(sentence_features, labels)
        dims_weights = dims_for_step(self.matryoshka_dims, self.matryoshka_weights, self.n_dims_per_step)
        loss_fn = partial(matryoshka_loss_from_embeddings, view.loss_from_embeddings, dims_weights=dims_weights)
        return gradcache_forward(view, sentence_features, labels, loss_fn)

    def get_config_dict(self) -> dict[str, Any]:
        return {
            "loss": type(self.loss).__name__,
            "matryoshka_dims": self.matryoshka_dims,
            "matryoshka_weights": self.matryoshka_weights,
            "n_dims_per_step": self.n_dims_per_step,
        }

    @property
    def citation(self) -> str:
        return MATRYOSHKA_CITATION


def refuse_cached(loss: nn.Module, wrapper: str) -> None:
    """Raise for a gradient-caching loss under a wrapper that swaps the model's forward pass."""
    if is_gradient_caching(loss):
        raise TypeError(
            f"{wrapper} cannot wrap {type(loss).__name__}: {wrapper} swaps the model's forward pass for the "
            f"duration of the forward call to read intermediate layers, but {type(loss).__name__} re-embeds "
            "its inputs during the backward pass (gradient caching), after the swap is undone, so its gradients "
            f"would belong to the wrong layers. Use {wrapper} with the non-cached loss (e.g. "
            "MultipleNegativesRankingLoss, GISTEmbedLoss), or st_ext.losses.MatryoshkaLoss for dimensions only."
        )


class AdaptiveLayerLoss(_upstream.AdaptiveLayerLoss):
    """Upstream's ``AdaptiveLayerLoss``, refusing cached losses (upstream only warns, then trains wrongly)."""

    def __init__(self, model: nn.Module, loss: nn.Module, *args: Any, **kwargs: Any) -> None:
        refuse_cached(loss, "AdaptiveLayerLoss")
        super().__init__(model, loss, *args, **kwargs)


class Matryoshka2dLoss(_upstream.Matryoshka2dLoss):
    """Upstream's ``Matryoshka2dLoss``, refusing cached losses (it is built on ``AdaptiveLayerLoss``)."""

    def __init__(self, model: nn.Module, loss: nn.Module, *args: Any, **kwargs: Any) -> None:
        refuse_cached(loss, "Matryoshka2dLoss")
        super().__init__(model, loss, *args, **kwargs)
