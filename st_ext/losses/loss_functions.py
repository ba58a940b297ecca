"""The contract of a loss over embeddings: a plain function, and how wrappers compose such functions.

``loss_fn(reps, labels, *, with_backward)`` is the loss over one batch's embeddings (:data:`Reps`); with
``with_backward`` it back-propagates into ``reps`` (chunk by chunk if it chunks) and returns the value
detached. A wrapper is a function from loss functions to loss functions that calls the wrapped one on
plain tensors (:func:`weighted_term`): Matryoshka calls it once per dimension on truncated copies, a layer-wise
loss once per layer. Embeddings from outside the batch (a cross-batch memory's queue) join it as data, a
:class:`BatchJoin`. What the engine runs, a description of the loss and one step of it, is in
:mod:`st_ext.losses.gradcache` beside the engine (docs/architecture.md).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn

from st_ext.losses.features import Features

#: Embeddings per input column, per mini-batch: ``reps[column][mini_batch]`` is ``(rows, dim)``.
Reps = list[list[Tensor]]
#: Where an output of the encoder comes from: None, the model's sentence embedding; a number, the hidden
#: state of that index (a layer-wise loss's earlier layers).
Source = int | None


class LossFn(Protocol):
    """The loss over one output's embeddings (module docstring)."""

    def __call__(self, reps: Reps, labels: Tensor | None, *, with_backward: bool) -> Tensor: ...


class Encoder(Protocol):
    """Embeds one mini-batch: the list of the model's outputs for its rows, each ``(rows, dim)``, the
    sentence embedding first."""

    def __call__(self, model: nn.Module, features: Features) -> list[Tensor]: ...


class BatchJoin(Protocol):
    """Embeddings that join a step's batch from outside it (a cross-batch memory's queue).

    ``columns`` are detached candidate columns appended to an output's reps before any loss function
    sees them, so that whatever a wrapper does to the batch (Matryoshka's truncation) it does to them;
    ``after_step`` receives every output's embeddings once the step's loss is computed (a wrapper around
    the joining loss runs the engine, so the engine hands them over)."""

    def columns(self, source: Source, like: Tensor) -> Reps: ...

    def after_step(self, sources: list[Source], outputs: list[Reps], labels: Tensor | None) -> None: ...


def weighted_term(loss_fn: LossFn, reps: Reps, labels: Tensor | None, weight: float, *, with_backward: bool) -> Tensor:
    """``weight * loss_fn(reps, labels)``, one term of a wrapper's weighted sum (a dimension's, a layer's). With
    ``with_backward``, ``loss_fn`` back-propagates into leaves of its own and ``weight`` times their gradient is
    carried on into ``reps`` (through the graph that made them, e.g. a truncation); the value comes back
    detached. Columns that need no gradient (a queue of earlier embeddings) are handed on as they are.
    """
    if not with_backward:
        return loss_fn(reps, labels, with_backward=False) * weight
    leaves = [[rep.detach().requires_grad_(rep.requires_grad) for rep in column] for column in reps]
    value = loss_fn(leaves, labels, with_backward=True)
    pairs = [
        (rep, leaf.grad * weight)
        for rep_column, leaf_column in zip(reps, leaves)
        for rep, leaf in zip(rep_column, leaf_column)
        if leaf.grad is not None
    ]
    if pairs:
        torch.autograd.backward([rep for rep, _ in pairs], [grad for _, grad in pairs])
    return value.detach() * weight


def plus_own_term(value: Tensor, term: Tensor) -> Tensor:
    """``value`` with a wrapper's own number ``term`` added (a layer-wise loss's KL divergence): to a number, or
    to the first of a loss's terms (the wrapped loss's own; the others are losses a sum added beside it)."""
    first = torch.zeros_like(value)
    first.view(-1)[0] = 1
    return value + term * first
