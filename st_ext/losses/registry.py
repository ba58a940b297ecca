"""Short loss names for the command line and config files.

``build_loss("matryoshka_cached_gist", model, guide=guide, matryoshka_dims=[384, 128, 64])`` builds
the same object as the Python spelled out. Every base name ``x`` also exists as ``matryoshka_x``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from st_ext._compat import embedding_dimension, st_losses
from st_ext.losses.cached_ranking import (
    CachedMultipleNegativesRankingLoss,
    CachedMultipleNegativesSymmetricRankingLoss,
)
from st_ext.losses.cross_batch_memory import DEFAULT_MEMORY_SIZE, CrossBatchMemoryLoss
from st_ext.losses.gist import CachedGISTEmbedLoss, GISTEmbedLoss
from st_ext.losses.matryoshka import MatryoshkaLoss
from st_ext.losses.triplet import BatchAllTripletLoss, BatchHardTripletLoss, BatchSemiHardTripletLoss

MATRYOSHKA_PREFIX = "matryoshka_"
#: The input columns a loss trains on; a label column last where it takes one.
PAIRS = "(anchor, positive[, negative_1, ...])"
_SCORED = "(sentence_A, sentence_B, score)"
_TRIPLETS = "(anchor, positive, negative)"
_LABELLED = "(text, label)"


@dataclass(frozen=True)
class LossSpec:
    """How to build one base loss (``build(model, **kwargs)``), which shared arguments it takes, and the
    ``columns`` it trains on."""

    build: Callable[..., nn.Module]
    description: str
    columns: str = PAIRS
    cached: bool = False
    guided: bool = False
    # A memory bank of a non-cached loss holds full-size embeddings that a Matryoshka wrapper cannot truncate.
    matryoshka: bool = True

    def trains_on(self, negatives: int) -> bool:
        """Whether it trains on (anchor, positive) rows with ``negatives`` hard-negative columns."""
        return self.columns == PAIRS or (self.columns == _TRIPLETS and negatives == 1)


def _upstream(class_name: str) -> Callable[..., nn.Module]:
    """A builder for an upstream loss, looked up when called (the namespace moved between releases)."""
    return lambda model, **kwargs: getattr(st_losses(), class_name)(model, **kwargs)


def with_memory(build_loss: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """A builder ``(model, memory_size=..., mask_own_positive=..., query_bank=..., **loss_kwargs)`` of
    ``build_loss(model, **loss_kwargs)`` wrapped in a CrossBatchMemoryLoss: the shape of a loss registry entry."""

    def build(
        model: nn.Module,
        memory_size: int = DEFAULT_MEMORY_SIZE,
        mask_own_positive: bool = True,
        query_bank: bool = False,
        **loss_kwargs: Any,
    ) -> CrossBatchMemoryLoss:
        inner = build_loss(model, **loss_kwargs)
        return CrossBatchMemoryLoss(
            model, inner, memory_size, mask_own_positive=mask_own_positive, query_bank=query_bank
        )

    return build


BASE_LOSSES: dict[str, LossSpec] = {
    "mnrl": LossSpec(_upstream("MultipleNegativesRankingLoss"), "in-batch negatives ranking (InfoNCE)"),
    "cached_mnrl": LossSpec(
        CachedMultipleNegativesRankingLoss, "mnrl with GradCache: any batch in mini-batch memory", cached=True
    ),
    "mnsrl": LossSpec(_upstream("MultipleNegativesSymmetricRankingLoss"), "mnrl in both directions"),
    "cached_mnsrl": LossSpec(CachedMultipleNegativesSymmetricRankingLoss, "mnsrl with GradCache", cached=True),
    "gist": LossSpec(GISTEmbedLoss, "mnrl whose guide model drops false negatives", guided=True),
    "cached_gist": LossSpec(CachedGISTEmbedLoss, "gist with GradCache", cached=True, guided=True),
    "cosent": LossSpec(_upstream("CoSENTLoss"), "ranks pairs by a similarity score", _SCORED),
    "angle": LossSpec(_upstream("AnglELoss"), "cosent in angle space", _SCORED),
    "cosine_similarity": LossSpec(_upstream("CosineSimilarityLoss"), "regresses cosine onto a score", _SCORED),
    "triplet": LossSpec(_upstream("TripletLoss"), "margin between a positive and a negative", _TRIPLETS),
    "batch_all_triplet": LossSpec(BatchAllTripletLoss, "every valid triplet of the batch's classes", _LABELLED),
    "batch_hard_triplet": LossSpec(BatchHardTripletLoss, "the hardest positive and negative per anchor", _LABELLED),
    "batch_semi_hard_triplet": LossSpec(BatchSemiHardTripletLoss, "semi-hard negatives per anchor", _LABELLED),
    "xbm_mnrl": LossSpec(
        with_memory(_upstream("MultipleNegativesRankingLoss")),
        "mnrl with a queue of earlier batches' documents",
        matryoshka=False,
    ),
    "xbm_cached_mnrl": LossSpec(
        with_memory(CachedMultipleNegativesRankingLoss),
        "cached_mnrl with a queue of earlier batches' documents",
        cached=True,
    ),
    "xbm_batch_all_triplet": LossSpec(
        with_memory(BatchAllTripletLoss), "batch_all_triplet with a queue of earlier rows", _LABELLED, matryoshka=False
    ),
    "xbm_batch_hard_triplet": LossSpec(
        with_memory(BatchHardTripletLoss),
        "batch_hard_triplet with a queue of earlier rows",
        _LABELLED,
        matryoshka=False,
    ),
    "xbm_batch_semi_hard_triplet": LossSpec(
        with_memory(BatchSemiHardTripletLoss),
        "batch_semi_hard_triplet with a queue of earlier rows",
        _LABELLED,
        matryoshka=False,
    ),
}


def loss_spec(name: str) -> LossSpec:
    """The spec of a known loss name (a ``matryoshka_`` name has its base loss's)."""
    return BASE_LOSSES[name.removeprefix(MATRYOSHKA_PREFIX)]


def describe_losses() -> list[str]:
    """One line per known name: the name, its input columns and what it does."""
    width = max(map(len, known_losses()))
    lines = []
    for name in known_losses():
        spec = loss_spec(name)
        description = spec.description + (
            ", at every Matryoshka dimension" if name.startswith(MATRYOSHKA_PREFIX) else ""
        )
        lines.append(f"{name:<{width}}  {spec.columns:<38}  {description}")
    return lines


def known_losses() -> list[str]:
    """Every name :func:`build_loss` accepts."""
    matryoshka_names = [MATRYOSHKA_PREFIX + name for name, spec in BASE_LOSSES.items() if spec.matryoshka]
    return sorted([*BASE_LOSSES, *matryoshka_names])


def build_loss(
    name: str,
    model: nn.Module,
    *,
    guide: nn.Module | None = None,
    mini_batch_size: int | str = 32,
    memory_budget_mb: float | None = None,
    kept_graphs: int | None = None,
    matryoshka_dims: Sequence[int] | None = None,
    matryoshka_weights: Sequence[float] | None = None,
    n_dims_per_step: int = -1,
    **kwargs: Any,
) -> nn.Module:
    """The loss called ``name`` (see :func:`known_losses`) for ``model``.

    ``mini_batch_size`` (a number or ``"auto"``), ``memory_budget_mb`` (for ``"auto"``) and ``kept_graphs``
    (for a number) apply to cached losses only; ``guide`` to GIST losses (which also take ``guide_embeddings=`` and
    ``offload_guide=``); ``matryoshka_*`` to Matryoshka names, whose dimensions default to the model's
    and its halvings down to 32. Other keywords go to the base loss.
    """
    matryoshka = name.startswith(MATRYOSHKA_PREFIX)
    base_name = name.removeprefix(MATRYOSHKA_PREFIX)
    if base_name not in BASE_LOSSES:
        raise ValueError(f"Unknown loss {name!r}. Known losses: {', '.join(known_losses())}.")
    spec = BASE_LOSSES[base_name]
    if matryoshka and not spec.matryoshka:
        raise ValueError(
            f"{base_name!r} keeps a memory of full-size embeddings that a non-cached loss cannot truncate; use it "
            f"without {MATRYOSHKA_PREFIX!r}, or its cached form."
        )
    if not matryoshka and (matryoshka_dims is not None or matryoshka_weights is not None):
        raise ValueError(f"matryoshka_dims/weights given for {name!r}; use {MATRYOSHKA_PREFIX + name!r}.")
    if spec.guided:
        if guide is None and kwargs.get("guide_embeddings") is None:
            raise ValueError(
                f"Loss {name!r} needs a guide model, guide_embeddings, or the model itself as its guide (guide=model)."
            )
        kwargs["guide"] = guide
    elif guide is not None:
        raise ValueError(f"Loss {name!r} takes no guide model; the GIST losses do ('gist', 'cached_gist').")
    if spec.cached:
        kwargs["mini_batch_size"] = mini_batch_size
        if memory_budget_mb is not None:
            kwargs["memory_budget_mb"] = memory_budget_mb
        if kept_graphs is not None:
            kwargs["kept_graphs"] = kept_graphs
    loss = spec.build(model, **kwargs)
    if not matryoshka:
        return loss
    if matryoshka_dims is None:
        embedding_dim = embedding_dimension(model)
        if embedding_dim is None:
            raise ValueError(f"{name!r} needs matryoshka_dims: the model does not declare its embedding dimension.")
        matryoshka_dims = [embedding_dim]
        while matryoshka_dims[-1] // 2 >= 32:
            matryoshka_dims.append(matryoshka_dims[-1] // 2)
    return MatryoshkaLoss(model, loss, matryoshka_dims, matryoshka_weights, n_dims_per_step)
