"""The one seam of the cached losses: a loss over cached embeddings, described as data (docs/architecture.md).

A wrapper is a function from one :class:`CachedLoss` to another, in the spirit of GradCache's
functional form: Matryoshka replaces the loss over embeddings by a weighted sum over truncations,
cross-batch memory adds its queue and enqueues in :attr:`LossStep.finish`, the layer-wise losses
embed several layers. None of them names another: each asks :func:`as_cached_loss` for what it
wraps, which answers from adapters registered per loss class (``register_cached_loss``); an adapter
only reads the loss it describes, and raises to refuse one no wrapper can run.

A loss written against the older protocol (``model``, ``mini_batch_size``, ``mini_batch_num_tokens``,
``show_progress_bar``, ``frozen_embeddings(features, ranges)``, ``loss_from_embeddings(reps, frozen,
labels, *, with_backward)``) is described by :func:`from_protocol`; the engine accepts it directly too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from torch import Tensor, nn

from st_ext.losses.auto_mini_batch import AUTO
from st_ext.losses.features import Features, Ranges
from st_ext.losses.overrides import upstream_hook_overrides

#: Embeddings per input column, per mini-batch: ``reps[column][mini_batch]`` is ``(rows, dim)``.
Reps = list[list[Tensor]]
#: ``loss_fn(reps, frozen, labels, *, with_backward, embedding_map=None)``: the loss over all embeddings.
#: With ``with_backward`` it back-propagates into ``reps`` (chunk by chunk if it chunks) and returns the
#: value detached. ``embedding_map`` is what a wrapper did to ``reps`` (a truncation), for embeddings the
#: loss holds itself and compares with them (a queue); None: nothing was done.
LossFn = Callable[..., Tensor]
#: ``frozen(sentence_features, ranges)``: a frozen encoder's embeddings per column (a guide's), or None.
FrozenFn = Callable[[list[Features], list[Ranges]], "Reps | None"]
#: Embeds one mini-batch: ``encoder(model, features)`` is the list of the model's outputs for its rows,
#: each ``(rows, dim)``, the sentence embedding first. ``encoder.layers`` (when it has it) names the hidden
#: state each later output comes from.
Encoder = Callable[[nn.Module, Features], list[Tensor]]


def sentence_embedding(model: nn.Module, features: Features) -> list[Tensor]:
    return [model(features)["sentence_embedding"]]


@dataclass(frozen=True)
class LossStep:
    """One forward pass of a cached loss.

    ``draw(layer)`` is the loss over embeddings for one call (``layer``: a hidden-state index, None for
    the model's output), drawing what the loss draws per call (Matryoshka's dimensions);
    ``finish(layers, outputs)`` runs once the step's loss is computed, with every output's :data:`Reps`
    and the layer each comes from (None: the model's output); ``encoder`` embeds each mini-batch. With
    ``over_layers`` the loss receives ``[reps of output 0, reps of output 1, …]`` instead of one ``Reps``.
    """

    draw: Callable[[Any], LossFn]
    finish: Callable[[list, list[Reps]], None] = lambda layers, outputs: None
    encoder: Encoder = sentence_embedding
    over_layers: bool = False


@dataclass(frozen=True)
class CachedLoss:
    """A loss over cached embeddings, as the engine runs it.

    ``mini_batch_size`` is a number or ``"auto"`` (resolved by ``auto``, an
    :class:`~st_ext.losses.auto_mini_batch.AutoMiniBatch`). ``start(sentence_features, mini_batch_size)``
    opens a forward pass, before any mini-batch is embedded, with the size resolved for this batch (a
    loss that scores its anchors a block at a time uses it as its block).
    """

    name: str
    model: nn.Module
    start: Callable[[list[Features], int], LossStep]
    mini_batch_size: int | str
    mini_batch_num_tokens: int | None = None
    auto: Any = None
    show_progress_bar: bool = False
    #: None: the loss has no frozen encoder.
    frozen: FrozenFn | None = None


_ADAPTERS: dict[type, Callable[[nn.Module], CachedLoss | None]] = {}


def register_cached_loss(loss_class: type, adapter: Callable[[nn.Module], CachedLoss | None]) -> None:
    """Make :func:`as_cached_loss` answer ``adapter(loss)`` for instances of ``loss_class`` and of its
    subclasses (unless a subclass registers its own). Registering a class again replaces its adapter."""
    _ADAPTERS[loss_class] = adapter


def as_cached_loss(loss: Any) -> CachedLoss | None:
    """``loss`` as a :class:`CachedLoss` when st_ext runs its GradCache, else None (a wrapper then
    treats it as upstream's wrapper would). The adapter of the first class along ``type(loss).__mro__``
    that has one decides; a subclass that overrides a step of upstream's engine gets None, since only
    upstream's engine calls it."""
    for cls in type(loss).__mro__:
        adapter = _ADAPTERS.get(cls)
        if adapter is not None:
            return None if upstream_hook_overrides(loss, cls) else adapter(loss)
    return None


def described(
    loss: Any, start: Callable[[list[Features], int], LossStep], frozen: FrozenFn | None = None
) -> CachedLoss:
    """A loss that keeps a cached loss's usual settings (``model``, ``mini_batch_size``, and where it has
    them ``mini_batch_num_tokens``, ``auto_mini_batch``, ``show_progress_bar``), with ``start`` and ``frozen``."""
    return CachedLoss(
        name=type(loss).__name__,
        model=loss.model,
        start=start,
        mini_batch_size=loss.mini_batch_size,
        mini_batch_num_tokens=getattr(loss, "mini_batch_num_tokens", None),
        auto=getattr(loss, "auto_mini_batch", None),
        show_progress_bar=getattr(loss, "show_progress_bar", False),
        frozen=frozen,
    )


def described_with(loss: Any, calculate: LossFn, frozen_fn: FrozenFn | None = None) -> CachedLoss:
    """``loss`` described with ``calculate(reps, frozen, labels, *, with_backward)`` as its loss over
    embeddings, which holds no embeddings of its own for a wrapper's ``embedding_map`` to apply to.

    ``calculate`` may score its anchors ``loss.mini_batch_size`` at a time (upstream's ``calculate_loss``,
    the older protocol): where that reads ``"auto"``, it reads the size resolved for the batch while
    ``calculate`` runs (the one place a loss's setting is written).
    """

    def start(sentence_features: list[Features], mini_batch_size: int) -> LossStep:
        def loss_fn(
            reps: Reps, frozen: Reps | None, labels: Tensor | None, *, with_backward: bool, embedding_map=None
        ) -> Tensor:
            if loss.mini_batch_size != AUTO:
                return calculate(reps, frozen, labels, with_backward=with_backward)
            loss.mini_batch_size = mini_batch_size
            try:
                return calculate(reps, frozen, labels, with_backward=with_backward)
            finally:
                loss.mini_batch_size = AUTO

        return LossStep(lambda layer: loss_fn)

    return described(loss, start, frozen_fn)


def from_protocol(loss: Any) -> CachedLoss:
    """A loss with the older protocol (module docstring), described."""
    return described_with(loss, loss.loss_from_embeddings, loss.frozen_embeddings)


def with_loss(description: CachedLoss, name: str, loss_for: Callable[..., LossStep]) -> CachedLoss:
    """``description`` whose every forward pass is ``loss_for(inner step, sentence_features, mini_batch_size)``:
    the shape of a wrapper."""
    inner_start = description.start

    def start(sentence_features: list[Features], mini_batch_size: int) -> LossStep:
        return loss_for(inner_start(sentence_features, mini_batch_size), sentence_features, mini_batch_size)

    return replace(description, name=name, start=start)
