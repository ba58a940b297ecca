"""Layer-wise GradCache: ``AdaptiveLayerLoss`` (and ``Matryoshka2dLoss``, :mod:`.matryoshka_2d`) over cached losses.

Upstream's layer wrappers run the wrapped loss once per sampled layer on the hidden states of one
forward pass with a graph, so their memory grows with the batch; over a cached loss they warn and
the memory bound is lost (the loss's backward hook re-embeds after the wrapper is gone). Here, over
a cached loss, the wrapper runs GradCache itself (:mod:`st_ext.losses.gradcache`):

    (1) embed each mini-batch once without a graph, keeping the pooled embedding of every layer the
        step uses (the sampled layers and the final one; :mod:`st_ext.losses.layer_embeddings`);
    (2) compute the whole loss on those embeddings: the final layer's loss, each sampled layer's
        loss (every Matryoshka dimension drawn for it), and the KL term between each sampled layer
        and the final one, back-propagating each term to the embeddings as it goes;
    (3) on ``loss.backward()``, re-embed one mini-batch at a time with a graph through the layers
        it needs, under the RNG state of its first pass, and back-propagate the summed gradients of
        all its layers at once.

Peak memory is one mini-batch's graph plus embedding-sized buffers per layer used. Layers and
dimensions are drawn from Python's ``random`` in upstream's order (the final layer's dimensions,
then the layers, then each layer's dimensions), so a seeded run trains what upstream's would. Which
hidden states upstream samples, how it weighs them and whether the KL teacher is detached depend on
the installed release (:class:`st_ext._compat.AdaptiveLayerRules`) and are followed here.

Over ``CrossBatchMemoryLoss`` (around a cached ranking loss) each layer ranks against its own queue
of that layer's embeddings from earlier steps (:func:`~st_ext.losses.cross_batch_memory.with_queue`). Over a loss
that does not cache, upstream's forward runs; ``Matryoshka2dLoss`` builds st_ext's ``MatryoshkaLoss``
(with its argument checks), and a memory around a non-cached loss is refused.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from st_ext._compat import AdaptiveLayerRules, st_losses
from st_ext.losses._signatures import PLACEHOLDER_LOSS, follows_upstream_signature, named_like_upstream
from st_ext.losses.cached_loss import CachedLoss, LossStep, as_cached_loss, register_cached_loss, with_loss
from st_ext.losses.gradcache import Features, LossFn, Reps, gradcache_forward, weighted_term
from st_ext.losses.layer_embeddings import LayerEmbeddings

_upstream = st_losses()

# ---------------------------------------------------------------------------------------------
# One step: the layers drawn, and the loss over their embeddings


def all_rows(reps: Reps) -> Tensor:
    """Every column's rows, one column after the other (the order upstream collects them in)."""
    return torch.cat([torch.cat(column) for column in reps])


class LayerStep:
    """What one forward pass of a layer-wise loss draws, and its loss over the cached embeddings.

    ``choose`` is called by :class:`~st_ext.losses.layer_embeddings.LayerEmbeddings` on the first
    forward pass; ``loss_from_layers`` is the loss over embeddings its ``LossStep`` draws, and receives
    ``[final layer's reps, first sampled layer's reps, …]``.
    """

    def __init__(self, wrapper: nn.Module, inner: LossStep) -> None:
        self.wrapper = wrapper
        self.inner = inner
        self.final_fn: LossFn | None = None
        #: The sampled layers' hidden-state indices, and their (weight, loss over embeddings), in the order drawn.
        self.layers: list[int] = []
        self.prior: list[tuple[float, LossFn]] = []

    def choose(self, num_hidden_states: int) -> list[int]:
        """Draw as upstream does: the final layer's call first, then the layers, then each layer's call."""
        self.final_fn = self.inner.draw(None)
        first = AdaptiveLayerRules.first_hidden_state
        num_layers = num_hidden_states - first
        indices = range(num_layers - 1)
        if 0 < self.wrapper.n_layers_per_step < num_layers - 1:
            indices = random.sample(indices, self.wrapper.n_layers_per_step)
        self.layers = [index + first for index in indices]
        self.prior = [
            (AdaptiveLayerRules.prior_layer_weight(self.wrapper, index), self.inner.draw(index + first))
            for index in indices
        ]
        return self.layers

    def loss_from_layers(
        self, outputs: list[Reps], frozen: Reps | None, labels: Tensor | None, *, with_backward: bool
    ) -> Tensor:
        wrapper = self.wrapper
        final, layers = outputs[0], outputs[1:]
        term = partial(weighted_term, frozen=frozen, labels=labels, with_backward=with_backward)
        if self.final_fn is None:  # no forward pass ran: an empty batch
            raise ValueError(f"{type(wrapper).__name__} got an empty batch.")
        total = term(self.final_fn, final, weight=wrapper.last_layer_weight)
        for (layer_weight, loss_fn), reps in zip(self.prior, layers):
            total = total + term(loss_fn, reps, weight=layer_weight / len(layers) * wrapper.prior_layers_weight)
        if layers and wrapper.kl_temperature > 0:
            kl = self._kl_terms(final, layers)
            if with_backward:
                kl.backward()
                kl = kl.detach()
            total = total + kl
        return total

    def _kl_terms(self, final: Reps, layers: list[Reps]) -> Tensor:
        """Upstream's self-distillation: each sampled layer's softened embeddings towards the final layer's."""
        temperature = self.wrapper.kl_temperature
        teacher = F.softmax(all_rows(final) / temperature, dim=-1)
        if AdaptiveLayerRules.detached_teacher:
            teacher = teacher.detach()
        total = 0
        for reps in layers:
            student = F.log_softmax(all_rows(reps) / temperature, dim=-1)
            total = (
                total + F.kl_div(student, teacher, reduction="batchmean") * temperature * self.wrapper.kl_div_weight
            )
        return total


# ---------------------------------------------------------------------------------------------
# The losses


def over_layers(description: CachedLoss, wrapper: nn.Module) -> CachedLoss:
    """``description`` trained at the final layer and at the layers ``wrapper`` draws, each call of its
    loss over embeddings drawn for its layer, with the KL term between them."""

    def layered(step: LossStep, sentence_features: list[Features], mini_batch_size: int) -> LossStep:
        layers = LayerStep(wrapper, step)
        return replace(
            step, draw=lambda layer: layers.loss_from_layers, encoder=LayerEmbeddings(layers.choose), over_layers=True
        )

    return with_loss(description, type(wrapper).__name__, layered)


class LayerwiseGradCache:
    """What both classes add to their upstream base: GradCache over layers when the wrapped loss caches."""

    def _set_up(self, model: nn.Module, loss: nn.Module, arguments: dict[str, Any]) -> None:
        layerwise = as_cached_loss(loss) is not None
        _upstream.AdaptiveLayerLoss.__init__(self, model, PLACEHOLDER_LOSS() if layerwise else loss, **arguments)
        self.loss = loss
        self.uses_gradient_cache = layerwise

    def forward(self, sentence_features: Iterable[Features], labels: Tensor | None = None) -> Tensor:
        if not self.uses_gradient_cache:
            return super().forward(sentence_features, labels)
        return gradcache_forward(over_layers(as_cached_loss(self.loss), self), sentence_features, labels)


LAYERWISE_NOTE = (
    "\n\n    st_ext: over a cached loss (st_ext's or upstream's ``CachedMultipleNegativesRankingLoss``, "
    "``CachedMultipleNegativesSymmetricRankingLoss``, ``CachedGISTEmbedLoss``, ``CrossBatchMemoryLoss`` over a "
    "cached ranking loss, or st_ext's ``MatryoshkaLoss`` over one of these) the layers are cached too: memory is "
    "bounded by one mini-batch (see :mod:`st_ext.losses.adaptive_layer`).\n"
)


@named_like_upstream(_upstream.AdaptiveLayerLoss)
class AdaptiveLayerLoss(LayerwiseGradCache, _upstream.AdaptiveLayerLoss):
    __doc__ = (
        _upstream.AdaptiveLayerLoss.__doc__ or _upstream.AdaptiveLayerLoss.__init__.__doc__ or ""
    ) + LAYERWISE_NOTE

    @follows_upstream_signature(_upstream.AdaptiveLayerLoss)
    def __init__(self, model: nn.Module, loss: nn.Module, **upstream_arguments: Any) -> None:
        self._set_up(model, loss, upstream_arguments)


def _refuse_wrapping(loss: nn.Module) -> None:
    """A layer-wise loss over a cached loss computes its gradients in its own backward pass: no wrapper can
    truncate or queue what it produces."""
    if loss.uses_gradient_cache:
        raise TypeError(
            f"A {type(loss).__name__} over a cached loss cannot be wrapped: its gradients are computed in its own "
            "backward pass. Put the other wrapper inside it (e.g. AdaptiveLayerLoss(model, MatryoshkaLoss(...))), "
            "or use Matryoshka2dLoss."
        )


register_cached_loss(LayerwiseGradCache, _refuse_wrapping)
