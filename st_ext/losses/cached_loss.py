"""The one contract of the cached losses: a loss over embeddings is a plain function (docs/architecture.md).

``loss_fn(reps, labels, *, with_backward)`` is the loss over one batch's embeddings (:data:`Reps`); with
``with_backward`` it back-propagates into ``reps`` (chunk by chunk if it chunks) and returns the value
detached. A wrapper is a function from loss functions to loss functions that calls the wrapped one on
plain tensors: Matryoshka calls it once per dimension on truncated copies, a layer-wise loss once per
layer. Embeddings a wrapper adds travel *inside* ``reps`` as extra columns (a cross-batch memory's
queue, as extra detached candidates), so whatever an outer wrapper does to the batch it does to them.

A :class:`CachedLoss` is what the engine runs: the model, the mini-batch setting, and ``start``, which
opens one forward pass (a :class:`LossStep`). st_ext's losses describe themselves (their
``cached_loss()`` method); upstream's cached losses are described by
:func:`st_ext.losses.loss_descriptions.as_cached_loss`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from torch import Tensor, nn

from st_ext.losses.features import Features, Ranges

#: Embeddings per input column, per mini-batch: ``reps[column][mini_batch]`` is ``(rows, dim)``.
Reps = list[list[Tensor]]
#: ``loss_fn(reps, labels, *, with_backward)``: the loss over one batch's embeddings (module docstring).
LossFn = Callable[..., Tensor]
#: ``loss(outputs, labels, *, with_backward)``: the loss over every output of the encoder (``outputs[0]``: the
#: sentence embedding's :data:`Reps`, then one per layer a layer-wise encoder adds).
OutputsLossFn = Callable[..., Tensor]
#: Embeds one mini-batch: ``encoder(model, features)`` is the list of the model's outputs for its rows,
#: each ``(rows, dim)``, the sentence embedding first. ``encoder.layers`` (when it has it) names the hidden
#: state each later output comes from.
Encoder = Callable[[nn.Module, Features], list[Tensor]]
#: ``candidates(sources, outputs)``: per output, the extra detached columns appended to its reps before the
#: loss sees them; ``sources[i]`` is where output ``i`` comes from (None: the model's output, else a layer).
CandidatesFn = Callable[[list, list[Reps]], list[Reps]]


def no_candidates(sources: list, outputs: list[Reps]) -> list[Reps]:
    return [[] for _ in outputs]


@dataclass(frozen=True)
class LossStep:
    """One forward pass of a cached loss.

    ``draw()`` is a loss function (:data:`LossFn`) for one call, drawing what the loss draws per call
    (Matryoshka's dimensions); ``over_outputs`` (None: ``draw()`` over the first output) is the loss over
    every output, for an encoder with several; ``candidates`` adds columns to each output's reps (module
    docstring); ``finish(sources, outputs)`` runs once the step's loss is computed, with every output's
    :data:`Reps` (without the added columns); ``encoder`` (None: the model's sentence embedding alone)
    embeds each mini-batch.
    """

    draw: Callable[[], LossFn]
    finish: Callable[[list, list[Reps]], None] = lambda sources, outputs: None
    encoder: Encoder | None = None
    candidates: CandidatesFn = no_candidates
    over_outputs: OutputsLossFn | None = None


@dataclass(frozen=True)
class CachedLoss:
    """A loss over cached embeddings, as the engine runs it.

    ``mini_batch_size`` is a number or ``"auto"`` (resolved by ``auto``, an
    :class:`~st_ext.losses.auto_mini_batch.AutoMiniBatch`, which also chooses how many graphs to keep);
    ``kept_graphs``: with a number, how many mini-batches keep their graph for the backward instead of
    being embedded again (0: every one is). ``start(sentence_features, ranges,
    mini_batch_size)`` opens a forward pass before any mini-batch is embedded, with each column's
    mini-batch row ranges (a frozen encoder embeds the same ones) and the size resolved for this batch (a
    loss that scores its anchors a block at a time uses it as its block).
    """

    name: str
    model: nn.Module
    start: Callable[[list[Features], list[Ranges], int], LossStep]
    mini_batch_size: int | str
    mini_batch_num_tokens: int | None = None
    auto: Any = None
    show_progress_bar: bool = False
    kept_graphs: int = 0


def described(loss: Any, start: Callable[[list[Features], list[Ranges], int], LossStep]) -> CachedLoss:
    """A loss that keeps a cached loss's usual settings (``model``, ``mini_batch_size``, and where it has
    them ``mini_batch_num_tokens``, ``auto_mini_batch``, ``show_progress_bar``, ``kept_graphs``), with
    ``start``."""
    return CachedLoss(
        name=type(loss).__name__,
        model=loss.model,
        start=start,
        mini_batch_size=loss.mini_batch_size,
        mini_batch_num_tokens=getattr(loss, "mini_batch_num_tokens", None),
        auto=getattr(loss, "auto_mini_batch", None),
        show_progress_bar=getattr(loss, "show_progress_bar", False),
        kept_graphs=getattr(loss, "kept_graphs", None) or 0,
    )


def with_loss(description: CachedLoss, name: str, loss_for: Callable[..., LossStep]) -> CachedLoss:
    """``description`` whose every forward pass is ``loss_for(inner step, sentence_features, ranges,
    mini_batch_size)``: the shape of a wrapper."""
    inner_start = description.start

    def start(sentence_features: list[Features], ranges: list[Ranges], mini_batch_size: int) -> LossStep:
        step = inner_start(sentence_features, ranges, mini_batch_size)
        return loss_for(step, sentence_features, ranges, mini_batch_size)

    return replace(description, name=name, start=start)
