"""A cached loss plus weighted losses over the same embeddings, trained in the cached loss's one GradCache pass.

EmbeddingGemma's recipe trains InfoNCE plus global orthogonal regularization (GOR) on the same embeddings;
upstream gives it as a module that embeds the batch once and sums the two, without caching. At the batch
sizes caching exists for, the other losses have to join the cached loss's own pass: they need only the
embeddings, which the engine holds for the whole batch. Here each added loss is one more term of the loss
function the engine calls per output (so a :class:`~st_ext.losses.MatryoshkaLoss` around the sum trains
every dimension on the sum), computed by the added loss's ``compute_loss_from_embeddings`` on the batch's own
columns (never on a cross-batch memory's queue) and back-propagated into the cached embeddings beside the
wrapped loss's gradient, so the second pass carries the sum. The loss returns each term by name, as
upstream's multi-term losses do: the trainer logs every term and back-propagates their sum.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from functools import partial

import torch
from torch import Tensor, nn

from st_ext._compat import loss_model, trainer_sums_loss_terms
from st_ext.losses.features import Features, Ranges
from st_ext.losses.gradcache import CachedLoss, LossStep, StartStep, gradcache_forward
from st_ext.losses.loss_descriptions import as_cached_loss, engine_description
from st_ext.losses.loss_functions import LossFn, Reps, Source, weighted_term


class EmbeddingLossSum(nn.Module):
    """``loss`` (a cached loss) plus ``weights[name] *`` each of ``extra_losses`` over the same embeddings.

    Args:
        loss: a loss st_ext's engine caches (``CachedMultipleNegativesRankingLoss``, ``CachedGISTEmbedLoss``, a
            ``CrossBatchMemoryLoss``, a ``MatryoshkaLoss`` over one of these, upstream's or st_ext's).
        extra_losses: name -> a loss over embeddings (one with ``compute_loss_from_embeddings(embeddings, labels)``,
            e.g. upstream's ``GlobalOrthogonalRegularizationLoss``) on the same model. A loss that returns a dict
            of terms is one term here, the sum of its values.
        weights: name -> weight of that loss (default 1.0 each).
        name: the wrapped loss's term name in the logs (default: its class name; never ``"loss"``, the trainer's
            name for the total).

    Example::

        loss = losses.EmbeddingLossSum(
            losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=64),
            {"gor": losses.GlobalOrthogonalRegularizationLoss(model)},
        )
        loss = losses.MatryoshkaLoss(model, loss, [768, 256, 64])  # every dimension trains on the sum
    """

    def __init__(
        self,
        loss: nn.Module,
        extra_losses: Mapping[str, nn.Module],
        weights: Mapping[str, float] | None = None,
        *,
        name: str | None = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        if not trainer_sums_loss_terms():
            raise RuntimeError(
                f"{owner} returns its terms by name, which this sentence-transformers' trainer cannot take: "
                "upgrade to 5.x or later, or sum the losses in a module of your own."
            )
        weights = dict(weights or {})
        name = type(loss).__name__ if name is None else name
        _check_terms(owner, loss, extra_losses, weights, name)
        self.model = loss_model(loss)
        self.loss = loss
        self.extra_losses = nn.ModuleDict(dict(extra_losses))
        #: Each added loss's weight, by name.
        self.weights = {key: float(weights.get(key, 1.0)) for key in extra_losses}
        self.name = name

    def forward(
        self, sentence_features: Iterable[Features], labels: Tensor | None = None
    ) -> Tensor | dict[str, Tensor]:
        return gradcache_forward(self.cached_loss(), sentence_features, labels)

    def cached_loss(self) -> CachedLoss:
        """The wrapped loss for the engine, each of its loss functions with the added losses' terms."""
        inner = engine_description(self.loss, type(self).__name__)
        return replace(
            inner, name=type(self).__name__, start=partial(self.start_step, inner.start), terms=self.term_names()
        )

    def get_config_dict(self) -> dict:
        """What the model card lists for this loss (upstream's losses' convention)."""
        return {
            "loss": type(self.loss).__name__,
            "extra_losses": {key: type(extra).__name__ for key, extra in self.extra_losses.items()},
            "weights": self.weights,
            "name": self.name,
        }

    def term_names(self) -> tuple[str, ...]:
        """The logged names of the terms, the wrapped loss's first."""
        return (self.name, *self.extra_losses)

    def start_step(
        self, inner_start: StartStep, sentence_features: list[Features], ranges: list[Ranges], mini_batch_size: int
    ) -> LossStep:
        """The wrapped loss's step, each output's loss function with the added terms over the batch's columns."""
        step = inner_start(sentence_features, ranges, mini_batch_size)
        return replace(step, loss_for=partial(self.loss_with_terms, step.loss_for, len(sentence_features)))

    def loss_with_terms(self, inner_loss_for: Callable[[Source], LossFn], columns: int, source: Source) -> LossFn:
        """``source``'s loss function: the wrapped one's value, then each added loss's, over the first ``columns``."""
        extras = [(self.extra_losses[key], self.weights[key]) for key in self.extra_losses]
        return partial(summed_terms, inner_loss_for(source), extras, columns)


def summed_terms(
    loss_fn: LossFn,
    extras: list[tuple[nn.Module, float]],
    columns: int,
    reps: Reps,
    labels: Tensor | None,
    *,
    with_backward: bool,
) -> Tensor:
    """The terms ``[loss_fn, weight * extra ...]`` over ``reps`` as one vector; with ``with_backward`` each term
    back-propagates into ``reps`` (gradients add up) and the values come back detached."""
    values = [loss_fn(reps, labels, with_backward=with_backward)]
    for extra, weight in extras:
        term = partial(loss_over_embeddings, extra, columns)
        values.append(weighted_term(term, reps, labels, weight, with_backward=with_backward))
    return torch.stack(values)


def loss_over_embeddings(extra: nn.Module, columns: int, reps: Reps, labels: Tensor | None, *, with_backward: bool):
    """``extra`` over the first ``columns`` of ``reps``, each a whole column; a dict of terms summed."""
    embeddings = [torch.cat(column) for column in reps[:columns]]
    value = getattr(extra, "compute_loss_from_embeddings")(embeddings, labels)
    if isinstance(value, Mapping):
        value = torch.stack(list(value.values())).sum()
    if with_backward:
        value.backward()
        value = value.detach()
    return value


def _check_terms(owner: str, loss: nn.Module, extra_losses: Mapping[str, nn.Module], weights: dict, name: str) -> None:
    """Refuse, at construction and in one line each, what the sum cannot train."""
    description = as_cached_loss(loss)
    if description is None:
        raise ValueError(
            f"{owner}: {type(loss).__name__} is not a cached loss st_ext's engine runs; without caching, sum the "
            "losses over one embedding pass in a module of your own (upstream's GlobalOrthogonalRegularizationLoss "
            "docstring shows one)."
        )
    if description.terms:
        raise ValueError(f"{owner}: the wrapped loss already sums terms; give one {owner} every added loss.")
    if not extra_losses:
        raise ValueError(f"{owner}: extra_losses is empty; give at least one name -> loss.")
    for key in (name, *extra_losses):
        if not isinstance(key, str) or not key or key == "loss":
            raise ValueError(f'{owner}: term names are non-empty strings other than "loss" (the total); got {key!r}.')
    if name in extra_losses:
        raise ValueError(f"{owner}: {name!r} names both the wrapped loss and an added one; give them different names.")
    model = loss_model(loss)
    for key, extra in extra_losses.items():
        if not callable(getattr(extra, "compute_loss_from_embeddings", None)):
            raise ValueError(
                f"{owner}: {key!r} ({type(extra).__name__}) has no compute_loss_from_embeddings(embeddings, labels), "
                "so it cannot score embeddings it did not compute."
            )
        if getattr(extra, "model", model) is not model:
            raise ValueError(f"{owner}: {key!r} is built on another model than the wrapped loss; use one model.")
    unknown = sorted(set(weights) - set(extra_losses))
    if unknown:
        raise ValueError(f"{owner}: weights name losses that extra_losses lacks: {', '.join(map(repr, unknown))}.")
    for key, weight in weights.items():
        if not isinstance(weight, numbers.Real) or isinstance(weight, bool):
            raise ValueError(f"{owner}: the weight of {key!r} must be a number, got {weight!r}.")
