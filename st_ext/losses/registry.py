"""Short loss names for the command line and config files.

``build_loss("matryoshka_cached_gist", model, guide=guide, matryoshka_dims=[384, 128, 64])`` builds
the same object as the Python spelled out. Every base name ``x`` also exists as ``matryoshka_x``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from torch import nn

from st_ext._compat import embedding_dimension, st_losses
from st_ext.losses.cached_ranking import CachedMultipleNegativesRankingLoss, CachedMultipleNegativesSymmetricRankingLoss
from st_ext.losses.cross_batch_memory import with_memory
from st_ext.losses.gist import CachedGISTEmbedLoss, GISTEmbedLoss
from st_ext.losses.matryoshka import MatryoshkaLoss
from st_ext.losses.triplet import BatchAllTripletLoss, BatchHardTripletLoss, BatchSemiHardTripletLoss

MATRYOSHKA_PREFIX = "matryoshka_"


@dataclass(frozen=True)
class LossSpec:
    """How to build one base loss: ``build(model, **kwargs)``, and which shared arguments it takes."""

    build: Callable[..., nn.Module]
    cached: bool = False
    guided: bool = False
    # A memory bank holds full-size embeddings, so truncating them per Matryoshka dim is refused.
    matryoshka: bool = True


def _upstream(class_name: str) -> Callable[..., nn.Module]:
    """A builder for an upstream loss, looked up when called (the namespace moved between releases)."""
    return lambda model, **kwargs: getattr(st_losses(), class_name)(model, **kwargs)


BASE_LOSSES: dict[str, LossSpec] = {
    "mnrl": LossSpec(_upstream("MultipleNegativesRankingLoss")),
    "cached_mnrl": LossSpec(CachedMultipleNegativesRankingLoss, cached=True),
    "mnsrl": LossSpec(_upstream("MultipleNegativesSymmetricRankingLoss")),
    "cached_mnsrl": LossSpec(CachedMultipleNegativesSymmetricRankingLoss, cached=True),
    "gist": LossSpec(GISTEmbedLoss, guided=True),
    "cached_gist": LossSpec(CachedGISTEmbedLoss, cached=True, guided=True),
    "cosent": LossSpec(_upstream("CoSENTLoss")),
    "angle": LossSpec(_upstream("AnglELoss")),
    "cosine_similarity": LossSpec(_upstream("CosineSimilarityLoss")),
    "triplet": LossSpec(_upstream("TripletLoss")),
    "batch_all_triplet": LossSpec(BatchAllTripletLoss),
    "batch_hard_triplet": LossSpec(BatchHardTripletLoss),
    "batch_semi_hard_triplet": LossSpec(BatchSemiHardTripletLoss),
    "xbm_mnrl": LossSpec(with_memory(_upstream("MultipleNegativesRankingLoss")), matryoshka=False),
    "xbm_cached_mnrl": LossSpec(with_memory(CachedMultipleNegativesRankingLoss), cached=True, matryoshka=False),
    "xbm_batch_all_triplet": LossSpec(with_memory(BatchAllTripletLoss), matryoshka=False),
    "xbm_batch_hard_triplet": LossSpec(with_memory(BatchHardTripletLoss), matryoshka=False),
    "xbm_batch_semi_hard_triplet": LossSpec(with_memory(BatchSemiHardTripletLoss), matryoshka=False),
}


def known_losses() -> list[str]:
    """Every name :func:`build_loss` accepts."""
    matryoshka_names = [MATRYOSHKA_PREFIX + name for name, spec in BASE_LOSSES.items() if spec.matryoshka]
    return sorted([*BASE_LOSSES, *matryoshka_names])


def default_matryoshka_dims(embedding_dim: int) -> list[int]:
    """The full dimension and its halvings down to 32 (or just the full one for tiny models)."""
    dims = [embedding_dim]
    while dims[-1] // 2 >= 32:
        dims.append(dims[-1] // 2)
    return dims


def build_loss(
    name: str,
    model: nn.Module,
    *,
    guide: nn.Module | None = None,
    mini_batch_size: int | str = 32,
    memory_budget_mb: float | None = None,
    matryoshka_dims: Sequence[int] | None = None,
    matryoshka_weights: Sequence[float] | None = None,
    n_dims_per_step: int = -1,
    **kwargs: Any,
) -> nn.Module:
    """The loss called ``name`` (see :func:`known_losses`) for ``model``.

    ``mini_batch_size`` (a number or ``"auto"``) and ``memory_budget_mb`` (for ``"auto"``) apply to
    cached losses only; ``guide`` to GIST losses (which also
    take ``guide_embeddings=`` and ``offload_guide=``); ``matryoshka_*`` to Matryoshka names, whose
    dimensions default to the model's and its halvings down to 32. Other keywords go to the base loss.
    """
    matryoshka = name.startswith(MATRYOSHKA_PREFIX)
    base_name = name[len(MATRYOSHKA_PREFIX) :] if matryoshka else name
    if base_name not in BASE_LOSSES:
        raise ValueError(f"Unknown loss {name!r}. Known losses: {', '.join(known_losses())}.")
    spec = BASE_LOSSES[base_name]
    if matryoshka and not spec.matryoshka:
        raise ValueError(f"{base_name!r} keeps a memory of full-size embeddings and cannot be truncated; use it without {MATRYOSHKA_PREFIX!r}.")
    if not matryoshka and (matryoshka_dims is not None or matryoshka_weights is not None):
        raise ValueError(f"matryoshka_dims/weights given for {name!r}; use {MATRYOSHKA_PREFIX + name!r}.")
    if spec.guided:
        if guide is None and kwargs.get("guide_embeddings") is None:
            raise ValueError(f"Loss {name!r} needs a guide model (or guide_embeddings).")
        kwargs["guide"] = guide
    elif guide is not None:
        raise ValueError(f"Loss {name!r} takes no guide model; the GIST losses do ('gist', 'cached_gist').")
    if spec.cached:
        kwargs["mini_batch_size"] = mini_batch_size
        if memory_budget_mb is not None:
            kwargs["memory_budget_mb"] = memory_budget_mb
    loss = spec.build(model, **kwargs)
    if not matryoshka:
        return loss
    if matryoshka_dims is None:
        embedding_dim = embedding_dimension(model)
        if embedding_dim is None:
            raise ValueError(f"{name!r} needs matryoshka_dims: the model does not declare its embedding dimension.")
        matryoshka_dims = default_matryoshka_dims(embedding_dim)
    return MatryoshkaLoss(model, loss, matryoshka_dims, matryoshka_weights, n_dims_per_step)
