"""Layer-wise GradCache: ``AdaptiveLayerLoss`` (and ``Matryoshka2dLoss``, :mod:`.matryoshka_2d`) over cached losses.

Upstream's layer wrappers need the hidden states of one forward pass with a graph, so over a cached
loss they lose the memory bound. Here the wrapper runs GradCache itself: step (1) keeps the pooled
embedding of every layer the step uses (:mod:`st_ext.losses.layer_embeddings`), step (2) computes the
final layer's loss, each sampled layer's and the KL terms on them, and step (3) back-propagates all
of a mini-batch's layers through one graph (docs/cached-losses.md). Layers and dimensions are drawn
from Python's ``random`` in upstream's order (the final layer's dimensions, then the layers, then
each layer's dimensions), and the release-dependent rules come from :class:`st_ext._compat.AdaptiveLayerRules`,
so a seeded run trains what upstream's would. Over ``CrossBatchMemoryLoss`` each layer ranks against
its own queue, around any loss a memory takes (:mod:`st_ext.losses.cross_batch_memory`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from st_ext._compat import AdaptiveLayerRules, st_losses
from st_ext.losses._signatures import PLACEHOLDER_LOSS, follows_upstream_signature, named_like_upstream
from st_ext.losses.features import Features, Ranges
from st_ext.losses.gradcache import LossStep, StartStep, gradcache_forward
from st_ext.losses.layer_embeddings import LayerEmbeddings
from st_ext.losses.loss_descriptions import as_cached_loss, engine_description
from st_ext.losses.loss_functions import LossFn, Reps, Source, plus_own_term, weighted_term

if TYPE_CHECKING:  # upstream's losses as 6.x places them; at run time, the installed release's
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import losses as _upstream
else:
    _upstream = st_losses()


def all_rows(reps: Reps) -> Tensor:
    """Every column's rows, one column after the other (the order upstream collects them in)."""
    return torch.cat([torch.cat(column) for column in reps])


class LayerDraws:
    """What one forward pass of a layer-wise loss draws (``choose``, on its first mini-batch): the final layer's
    loss function, the layers, and each layer's loss function, each from the wrapped step's ``loss_for``."""

    def __init__(
        self, wrapper: _upstream.AdaptiveLayerLoss, loss_for: Callable[[Source], LossFn], columns: list[Features]
    ) -> None:
        self.wrapper = wrapper
        self.loss_for = loss_for
        self.columns = columns
        self.final_fn: LossFn | None = None
        #: The sampled layers' hidden-state indices and (weight, loss function), in the order drawn.
        self.layers: list[int] = []
        self.prior: list[tuple[float, LossFn]] = []

    def choose(self, num_hidden_states: int) -> list[int]:
        """Draw as upstream does: the final layer's call first, then the layers, then each layer's call."""
        self.final_fn = self.loss_for(None)
        first = AdaptiveLayerRules.first_hidden_state
        num_layers = num_hidden_states - first
        indices: Sequence[int] = range(num_layers - 1)
        if 0 < self.wrapper.n_layers_per_step < num_layers - 1:
            indices = random.sample(indices, self.wrapper.n_layers_per_step)
        self.layers = [index + first for index in indices]
        self.prior = [
            (AdaptiveLayerRules.prior_layer_weight(self.wrapper, index), self.loss_for(index + first))
            for index in indices
        ]
        return self.layers

    def loss_from_layers(self, outputs: list[Reps], labels: Tensor | None, *, with_backward: bool) -> Tensor:
        """The weighted losses of every output (each with the columns a wrapped loss added), and the KL terms
        on the model's own embeddings."""
        wrapper = self.wrapper
        final, layers = outputs[0], outputs[1:]
        term = partial(weighted_term, labels=labels, with_backward=with_backward)
        if self.final_fn is None:  # no forward pass ran: an empty batch
            raise ValueError(f"{type(wrapper).__name__} got an empty batch.")
        total = term(self.final_fn, final, weight=wrapper.last_layer_weight)
        for (layer_weight, loss_fn), reps in zip(self.prior, layers):
            total = total + term(loss_fn, reps, weight=layer_weight / len(layers) * wrapper.prior_layers_weight)
        if layers and wrapper.kl_temperature > 0:
            embedded = len(self.columns)
            kl = self._kl_terms(final[:embedded], [reps[:embedded] for reps in layers])
            if with_backward:
                kl.backward()
                kl = kl.detach()
            total = plus_own_term(total, kl)
        return total

    def _kl_terms(self, final: Reps, layers: list[Reps]) -> Tensor:
        """Upstream's self-distillation: each sampled layer's softened embeddings towards the final layer's."""
        temperature = self.wrapper.kl_temperature
        teacher = F.softmax(all_rows(final) / temperature, dim=-1)
        if AdaptiveLayerRules.detached_teacher:
            teacher = teacher.detach()
        terms = [
            F.kl_div(F.log_softmax(all_rows(reps) / temperature, dim=-1), teacher, reduction="batchmean")
            * temperature
            * self.wrapper.kl_div_weight
            for reps in layers
        ]
        total = terms[0]
        for kl in terms[1:]:
            total = total + kl
        return total


@dataclass(frozen=True)
class LayerwiseStep(LossStep):
    """A step whose encoder also pools the layers ``draws`` chooses, and whose loss spans all of them."""

    draws: LayerDraws = field(kw_only=True)

    def sources(self) -> list[Source]:
        return [None, *self.draws.layers]

    def loss(self, outputs: list[Reps], labels: Tensor | None, *, with_backward: bool) -> Tensor:
        return self.draws.loss_from_layers(outputs, labels, with_backward=with_backward)


class LayerwiseGradCache(_upstream.AdaptiveLayerLoss):
    """What both classes add to their upstream base: GradCache over layers when the wrapped loss caches."""

    def _set_up(self, model: SentenceTransformer, loss: nn.Module, arguments: dict[str, Any]) -> None:
        layerwise = as_cached_loss(loss) is not None
        _upstream.AdaptiveLayerLoss.__init__(self, model, PLACEHOLDER_LOSS() if layerwise else loss, **arguments)
        self.loss = loss
        self.uses_gradient_cache = layerwise

    # Over an EmbeddingLossSum the value is its terms by name, where upstream's forward returns one tensor.
    def forward(  # type: ignore[override]
        self, sentence_features: Iterable[Features], labels: Tensor | None = None
    ) -> Tensor | dict[str, Tensor]:
        if not self.uses_gradient_cache:
            # Upstream annotates labels as a tensor, but passes None on to a loss that takes no labels.
            return super().forward(sentence_features, labels)  # type: ignore[arg-type]
        inner = engine_description(self.loss, type(self).__name__)
        description = replace(inner, name=type(self).__name__, start=partial(self.start_step, inner.start))
        return gradcache_forward(description, sentence_features, labels)

    def start_step(
        self, inner_start: StartStep, sentence_features: list[Features], ranges: list[Ranges], mini_batch_size: int
    ) -> LayerwiseStep:
        """The wrapped loss's step (``inner_start``'s), trained at the final layer and at the layers drawn on the
        first mini-batch."""
        step = inner_start(sentence_features, ranges, mini_batch_size)
        draws = LayerDraws(self, step.loss_for, sentence_features)
        return LayerwiseStep(step.loss_for, LayerEmbeddings(draws.choose), step.join, draws=draws)

    def cached_loss(self) -> None:
        """None (upstream's implementation runs a wrapper around it) unless it caches, which no wrapper can
        wrap: its gradients are computed in its own backward pass."""
        if self.uses_gradient_cache:
            raise TypeError(
                f"A {type(self).__name__} over a cached loss cannot be wrapped: its gradients are computed in its "
                "own backward pass. Put the other wrapper inside it (e.g. AdaptiveLayerLoss(model, "
                "MatryoshkaLoss(...))), or use Matryoshka2dLoss."
            )
        return None


LAYERWISE_NOTE = (
    "over a cached loss (st_ext's or upstream's ``CachedMultipleNegativesRankingLoss``, "
    "``CachedMultipleNegativesSymmetricRankingLoss``, ``CachedGISTEmbedLoss``, any ``CrossBatchMemoryLoss``, or "
    "st_ext's ``MatryoshkaLoss`` over one of these) the layers are cached too: memory is "
    "bounded by one mini-batch (see :mod:`st_ext.losses.adaptive_layer`)."
)


@named_like_upstream(_upstream.AdaptiveLayerLoss, LAYERWISE_NOTE)
class AdaptiveLayerLoss(LayerwiseGradCache, _upstream.AdaptiveLayerLoss):
    if not TYPE_CHECKING:  # a type checker reads upstream's constructor, which this one takes as it is

        @follows_upstream_signature(_upstream.AdaptiveLayerLoss)
        def __init__(self, model: nn.Module, loss: nn.Module, **upstream_arguments: Any) -> None:
            self._set_up(model, loss, upstream_arguments)
