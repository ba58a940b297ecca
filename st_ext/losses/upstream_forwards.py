"""sentence-transformers' own cached losses, every archetype's, forwarded by st_ext's GradCache engine.

Upstream's engine back-propagates each mini-batch from a hook on a loss without a ``grad_fn``: DeepSpeed's
``engine.backward`` refuses that loss, ZeRO 2/3 then refuse the second reduction of a step, and FSDP2
reduce-scatters after every mini-batch. st_ext's trainers call :func:`engine_forward`'s forward in place
of such a loss's own; the loss object is untouched and its own ``calculate_loss`` computes the loss over
the cached outputs. st_ext's engine holds the reduction until the step's last mini-batch and returns a
loss with a ``grad_fn`` (:mod:`st_ext.losses.gradcache`). What each archetype caches:

* SentenceTransformer (ranking, GIST, ``MegaBatchMarginLoss``): the sentence embeddings, as described by
  :func:`~st_ext.losses.loss_descriptions.upstream_description`.
* SparseEncoder's ``CachedSpladeLoss``: the sparse embeddings; its forward also returns each term of the
  loss for the trainer's logs, rebuilt here around the engine's total as upstream's forward does.
* CrossEncoder's ``CachedMultipleNegativesRankingLoss`` (6.x): one logit per (anchor, candidate) pair; the
  pairs are built as upstream's forward builds them and tokenized as one column.
* ``CachedMultiVectorMultipleNegativesRankingLoss``: token embeddings and their scoring masks; the engine's
  encoder returns both, the mask as a second output that takes no gradient.

``mini_batch_size="auto"`` probes the model's ``sentence_embedding``: the SentenceTransformer and
SparseEncoder losses take it, the CrossEncoder and multi-vector ones are refused (:func:`refusal`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from st_ext._compat import (
    archetype_loss_class,
    cross_encoder_scores_features,
    splade_component_values,
    unwrapped_model,
)
from st_ext.losses.auto_mini_batch import AUTO, AutoMiniBatch, make_auto_mini_batch
from st_ext.losses.gradcache import Features, LossStep, described, gradcache_forward
from st_ext.losses.loss_descriptions import upstream_description
from st_ext.losses.loss_functions import Reps

if TYPE_CHECKING:
    from sentence_transformers import CrossEncoder


@dataclass(frozen=True)
class EngineForward:
    """How a trainer forwards ``loss`` on st_ext's engine: ``forward(features, labels, **keywords)``, where
    ``keywords`` are the trainer inputs named in ``trainer_keywords`` (CrossEncoder: prompt and task);
    ``auto`` keeps ``mini_batch_size="auto"``'s choice across steps. Each call describes the loss anew: the
    trainer swaps the engine's wrapper (DDP, DeepSpeed) in as its model after the first."""

    loss: nn.Module
    forward: Callable[..., Tensor | dict[str, Tensor]]
    trainer_keywords: tuple[str, ...] = ()
    auto: AutoMiniBatch | None = None


def engine_forward(loss: Any) -> EngineForward | None:
    """How st_ext's engine forwards ``loss``, one of upstream's cached losses; None for any other loss (st_ext's
    own run the engine from their own forward) and for one st_ext cannot run (see :func:`refusal`)."""
    if not isinstance(loss, nn.Module) or callable(getattr(loss, "cached_loss", None)) or refusal(loss):
        return None
    cross_encoder = archetype_loss_class("cross_encoder", "CachedMultipleNegativesRankingLoss")
    if cross_encoder is not None and isinstance(loss, cross_encoder):
        if not cross_encoder_scores_features(type(loss)) or _overrides_any_step(
            loss, cross_encoder, _CROSS_ENCODER_STEPS
        ):
            return None
        return EngineForward(loss, lambda *args, **kw: cross_encoder_forward(loss, *args, **kw), ("prompt", "task"))
    multi_vector = archetype_loss_class("multi_vector_encoder", "CachedMultiVectorMultipleNegativesRankingLoss")
    if multi_vector is not None and isinstance(loss, multi_vector):
        if _overrides_any_step(loss, multi_vector, _MULTI_VECTOR_STEPS):
            return None
        return EngineForward(loss, lambda features, labels: multi_vector_forward(loss, features, labels))
    if upstream_description(loss) is None:
        return None
    auto = make_auto_mini_batch(loss.mini_batch_size, getattr(loss, "mini_batch_num_tokens", None), None)
    splade = archetype_loss_class("sparse_encoder", "CachedSpladeLoss")
    if splade is not None and isinstance(loss, splade):
        return EngineForward(loss, lambda features, labels: splade_forward(loss, auto, features, labels), auto=auto)

    def forward(features: list[Features], labels: Tensor | None) -> Tensor | dict[str, Tensor]:
        description = upstream_description(loss)
        assert description is not None, "checked above: upstream_description describes this loss"
        return gradcache_forward(replace(description, auto=auto), features, labels)

    return EngineForward(loss, forward, auto=auto)


#: The steps of upstream's own engine in these classes: a subclass that overrides one runs its own forward.
_CROSS_ENCODER_STEPS = ("predict_minibatch", "predict_minibatch_iter", "calculate_loss_and_cache_gradients", "forward")
_MULTI_VECTOR_STEPS = ("embed_minibatch", "embed_minibatch_iter", "calculate_loss_and_cache_gradients", "forward")


def _overrides_any_step(loss: nn.Module, upstream_class: type, steps: tuple[str, ...]) -> bool:
    """Whether ``type(loss)`` replaces one of ``upstream_class``'s ``steps`` (then upstream's own forward runs it)."""
    return any(getattr(type(loss), name) is not getattr(upstream_class, name) for name in steps)


def refusal(loss: Any) -> str | None:
    """Why st_ext's trainers cannot run ``loss`` with ``mini_batch_size="auto"``, in one line; None where they can."""
    if getattr(loss, "mini_batch_size", None) != AUTO:
        return None
    for archetype, name in (
        ("cross_encoder", "CachedMultipleNegativesRankingLoss"),
        ("multi_vector_encoder", "CachedMultiVectorMultipleNegativesRankingLoss"),
    ):
        upstream_class = archetype_loss_class(archetype, name)
        if upstream_class is not None and isinstance(loss, upstream_class):
            return (
                f"{name} with mini_batch_size='auto': the auto mode measures a model's sentence embedding, which "
                "this archetype's model does not output; give mini_batch_size a number."
            )
    return None


def splade_forward(
    loss: Any, auto: AutoMiniBatch | None, sentence_features: list[Features], labels: Tensor | None
) -> dict[str, Tensor]:
    """``CachedSpladeLoss``'s value on st_ext's engine, as its forward returns it: each term of the loss, the
    first adjusted so that the terms sum to the engine's total, which alone carries the gradient. Its loss
    reads no mini-batch size and records its terms on the instance it runs on: this one."""
    description = described(loss, lambda *step_settings: LossStep(lambda source: loss.calculate_loss))
    total = gradcache_forward(replace(description, auto=auto), sentence_features, labels)
    assert isinstance(total, Tensor), "a described loss has no terms: the engine returns its one value"
    values = splade_component_values(loss)
    first = next(iter(values))
    components = {key: torch.tensor(value, device=total.device) for key, value in values.items()}
    others = sum((value for key, value in components.items() if key != first), start=torch.zeros_like(total))
    components[first] = total - others
    return components


def cross_encoder_forward(
    loss: Any, inputs: list[list[str]], labels: Tensor | None, prompt: str | None = None, task: str | None = None
) -> Tensor | dict[str, Tensor]:
    """CrossEncoder's ``CachedMultipleNegativesRankingLoss`` on st_ext's engine: its pairs, in its order (each
    anchor with its positive, then with each drawn in-batch negative, then with each hard negative), tokenized
    by the model and scored a mini-batch at a time."""
    anchors, candidates = list(inputs[0]), list(inputs[1])
    batch_size = len(anchors)
    for negatives in loss.get_in_batch_negatives(inputs[0], inputs[1:]):
        anchors += inputs[0]
        candidates += negatives
    for negatives in inputs[2:]:
        anchors += inputs[0]
        candidates += negatives
    model = cast("CrossEncoder", unwrapped_model(loss.model))
    features = model.preprocess(list(zip(anchors, candidates)), prompt=prompt, task=task)
    features = {key: value.to(model.device) if isinstance(value, Tensor) else value for key, value in features.items()}

    def start(sentence_features: list[Features], ranges, mini_batch_size: int) -> LossStep:
        def loss_fn(reps: Reps, labels: Tensor | None, *, with_backward: bool) -> Tensor:
            value = loss.calculate_loss(reps[0], batch_size)
            if with_backward:
                value.backward()
                value = value.detach()
            return value

        return LossStep(lambda source: loss_fn, encoder=_pair_scores)

    return gradcache_forward(described(loss, start), [features], labels)


def _pair_scores(model: nn.Module, features: Features) -> list[Tensor]:
    return [model(features)["scores"].squeeze(1)]


def multi_vector_forward(
    loss: Any, sentence_features: list[Features], labels: Tensor | None
) -> Tensor | dict[str, Tensor]:
    """``CachedMultiVectorMultipleNegativesRankingLoss`` on st_ext's engine: each column carries its task (the
    anchors are queries, the rest documents, unless the collator set one), as upstream's forward stamps it."""
    sentence_features = [
        {**features, "task": features.get("task", "query" if index == 0 else "document")}
        for index, features in enumerate(sentence_features)
    ]

    def start(sentence_features: list[Features], ranges, mini_batch_size: int) -> LossStep:
        return TokenEmbeddingsStep(lambda source: loss.calculate_loss, encoder=_token_embeddings_and_masks)

    return gradcache_forward(described(loss, start), sentence_features, labels)


@dataclass(frozen=True)
class TokenEmbeddingsStep(LossStep):
    """A step of the multi-vector loss: its encoder gives each mini-batch's token embeddings and scoring mask,
    and its loss (``loss_for``'s: upstream's ``calculate_loss``) takes both."""

    def loss(self, outputs: list[Reps], labels: Tensor | None, *, with_backward: bool) -> Tensor:
        embeddings, masks = outputs
        masks = [[mask.detach().bool() for mask in column] for column in masks]
        # Upstream's multi-vector calculate_loss takes the scoring masks where a LossFn takes labels.
        return self.loss_for(None)(embeddings, masks, with_backward=with_backward)  # type: ignore[arg-type]


def _token_embeddings_and_masks(model: nn.Module, features: Features) -> list[Tensor]:
    """A mini-batch's token embeddings, and its scoring mask (after ``MultiVectorMask``) in their dtype."""
    outputs = model(features, task=features.get("task"))
    embeddings = outputs["token_embeddings"]
    return [embeddings, outputs["attention_mask"].to(embeddings.dtype)]
