"""The loss a layer-wise wrapper trains at every layer, as a loss over cached embeddings.

:mod:`st_ext.losses.adaptive_layer` computes the wrapped loss once for the final layer and once for
each sampled layer, on embeddings GradCache cached. What that takes depends on the wrapped loss:

* a cached loss (any with a :func:`~st_ext.losses.cached_adapters.cached_loss_view`): its loss over
  embeddings, the same at every layer;
* st_ext's ``MatryoshkaLoss`` over one of these: the same, at dimensions drawn anew for every layer,
  as upstream's ``Matryoshka2dLoss`` draws them;
* ``CrossBatchMemoryLoss`` over a cached ranking loss: each layer ranks against its own queue of
  earlier steps' embeddings of that layer (the final layer against the usual one), and after the
  step each layer's documents join its queue. One queue for all layers would put final-layer
  embeddings among an earlier layer's candidates: another embedding space, negatives in name only.
  A layer's queue grows only on steps that sample it (with ``n_layers_per_step=1`` of L layers,
  about L times more slowly than the final one, so its rows are older), and every queue holds up to
  ``memory_size`` rows: (sampled layers + 1) × ``memory_size`` embeddings in all.

Anything else is left to upstream's wrapper (:func:`runs_layerwise` is False).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from st_ext.losses.cached_adapters import cached_loss_view
from st_ext.losses.cross_batch_memory import (
    CrossBatchMemoryLoss,
    MemoryBank,
    document_rows,
    memory_ranking_fn,
    ranking_batch,
)
from st_ext.losses.gradcache import CachedLoss, Features, LossFn, Reps
from st_ext.losses.matryoshka import MatryoshkaLoss, dims_for_step, matryoshka_loss_from_embeddings


def _no_finish(layers: list, outputs: list[Reps]) -> None:
    return None


@dataclass(frozen=True)
class LayerwiseInner:
    """The wrapped loss for one forward pass: its mini-batch settings and frozen encoders (``view``);
    ``draw(layer)``, the loss over embeddings for that layer's call (``layer``: a hidden-state index, None
    for the model's output), drawing what the loss draws per call; and ``finish(layers, outputs)``,
    called with every layer's cached embeddings once the step's loss is computed."""

    view: CachedLoss
    draw: Callable[[int | None], LossFn]
    finish: Callable[[list, list[Reps]], None] = _no_finish


def _parts(loss: nn.Module) -> tuple[MatryoshkaLoss | None, nn.Module]:
    """(the MatryoshkaLoss around the loss, if any; the loss inside it)."""
    if isinstance(loss, MatryoshkaLoss):
        return loss, loss.loss
    return None, loss


def runs_layerwise(loss: nn.Module) -> bool:
    """Whether st_ext caches the layers of a layer-wise wrapper around ``loss``."""
    matryoshka, base = _parts(loss)
    if isinstance(base, CrossBatchMemoryLoss):
        return base.kind == "ranking" and base.uses_gradient_cache
    if matryoshka is not None and not matryoshka.uses_gradient_cache:
        return False
    return cached_loss_view(base) is not None


def layerwise_inner(loss: nn.Module, sentence_features: list[Features]) -> LayerwiseInner:
    """``loss`` for one forward pass over ``sentence_features``; only for a loss that :func:`runs_layerwise`."""
    matryoshka, base = _parts(loss)
    if isinstance(base, CrossBatchMemoryLoss):
        inner = _with_memory(base, sentence_features, truncated=matryoshka is not None)
    else:
        view = cached_loss_view(base)
        inner = LayerwiseInner(view, lambda layer: view.loss_from_embeddings)
    if matryoshka is None:
        return inner

    def draw_dims(layer: int | None) -> LossFn:
        loss_fn = inner.draw(layer)
        dims_weights = dims_for_step(matryoshka.matryoshka_dims, matryoshka.matryoshka_weights, matryoshka.n_dims_per_step)
        return partial(matryoshka_loss_from_embeddings, loss_fn, dims_weights=dims_weights)

    return replace(inner, draw=draw_dims)


def _check_same_layers_on_every_rank(layers: list) -> None:
    """Every rank's documents join the queue of the layer each rank drew; ranks that drew differently
    (Python's ``random`` seeded differently) would mix layers in one queue without any shape error."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    drawn: list = [None] * dist.get_world_size()
    dist.all_gather_object(drawn, layers)
    if any(other != layers for other in drawn):
        raise RuntimeError(
            f"The ranks sampled different layers ({drawn}): each layer's cross-batch memory would mix them. Seed "
            "Python's random module alike on every rank (the Trainer's seed does), or set n_layers_per_step=-1."
        )


def _with_memory(memory: CrossBatchMemoryLoss, sentence_features: list[Features], *, truncated: bool) -> LayerwiseInner:
    batch = ranking_batch(memory.loss, sentence_features, memory.mask_own_positive)
    view = cached_loss_view(memory.loss)
    training = torch.is_grad_enabled()

    def draw(layer: int | None) -> LossFn:
        bank = memory.bank(layer) if training else MemoryBank()
        return memory_ranking_fn(bank, batch, view, truncated=truncated)

    def finish(layers: list, outputs: list[Reps]) -> None:
        if not training:
            return
        _check_same_layers_on_every_rank(layers)
        for layer, reps in zip(layers, outputs):
            documents = document_rows(reps)
            memory.push(layer, documents, batch.row_keys(documents.device))

    return LayerwiseInner(view, draw, finish)
