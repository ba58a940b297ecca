"""sentence-transformers' losses, with st_ext's memory-bounded versions in place of their upstream namesakes.

``from st_ext import losses`` works as ``from sentence_transformers import losses``: every upstream
loss name is here. st_ext replaces the cached ranking losses (st_ext's GradCache engine, with
``mini_batch_size="auto"``), :class:`MatryoshkaLoss`, :class:`AdaptiveLayerLoss` and
:class:`Matryoshka2dLoss` (over cached losses, in mini-batch memory), :class:`GISTEmbedLoss` and
:class:`CachedGISTEmbedLoss` (a guide offloaded or precomputed as :class:`GuideEmbeddings`),
:class:`DistillationLoss` (a teacher live, offloaded or precomputed as :class:`TeacherLabels`) and the
batch triplet losses (without B×B×B tensors, with an optional memory of references); it adds
:class:`CrossBatchMemoryLoss`, :class:`EmbeddingLossSum` (losses over the same embeddings added to a cached
loss's pass) and :func:`build_loss` / :func:`known_losses` (short names for the command line).

Each replacement takes upstream's positional arguments in the installed release's order (st_ext's own
options are keyword-only), raises and warns as upstream does, and appears in the model card under
upstream's name, documentation link and parameters (:mod:`st_ext.losses._signatures`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from st_ext._compat import st_losses as _st_losses

if TYPE_CHECKING:  # upstream's losses as 6.x places them; at run time, the installed release's (its __all__)
    from sentence_transformers.sentence_transformer.losses import (
        AnglELoss as AnglELoss,
        BatchHardSoftMarginTripletLoss as BatchHardSoftMarginTripletLoss,
        BatchHardTripletLossDistanceFunction as BatchHardTripletLossDistanceFunction,
        ContrastiveLoss as ContrastiveLoss,
        ContrastiveTensionDataLoader as ContrastiveTensionDataLoader,
        ContrastiveTensionLoss as ContrastiveTensionLoss,
        ContrastiveTensionLossInBatchNegatives as ContrastiveTensionLossInBatchNegatives,
        CoSENTLoss as CoSENTLoss,
        CosineSimilarityLoss as CosineSimilarityLoss,
        DenoisingAutoEncoderLoss as DenoisingAutoEncoderLoss,
        DistillKLDivLoss as DistillKLDivLoss,
        EmbedDistillLoss as EmbedDistillLoss,
        GlobalOrthogonalRegularizationLoss as GlobalOrthogonalRegularizationLoss,
        MarginMSELoss as MarginMSELoss,
        MegaBatchMarginLoss as MegaBatchMarginLoss,
        MSELoss as MSELoss,
        MultipleNegativesRankingLoss as MultipleNegativesRankingLoss,
        MultipleNegativesSymmetricRankingLoss as MultipleNegativesSymmetricRankingLoss,
        OnlineContrastiveLoss as OnlineContrastiveLoss,
        SiameseDistanceMetric as SiameseDistanceMetric,
        SoftmaxLoss as SoftmaxLoss,
        TripletDistanceMetric as TripletDistanceMetric,
        TripletLoss as TripletLoss,
    )


_upstream_losses = _st_losses()
_UPSTREAM_NAMES = [name for name in _upstream_losses.__all__ if not name.startswith("_")]
globals().update({name: getattr(_upstream_losses, name) for name in _UPSTREAM_NAMES})

from st_ext.losses.adaptive_layer import AdaptiveLayerLoss  # noqa: E402
from st_ext.losses.cached_ranking import (  # noqa: E402
    CachedMultipleNegativesRankingLoss,
    CachedMultipleNegativesSymmetricRankingLoss,
)
from st_ext.losses.cross_batch_memory import CrossBatchMemoryLoss  # noqa: E402
from st_ext.losses.distillation import DistillationLoss, TeacherLabels  # noqa: E402
from st_ext.losses.embedding_loss_sum import EmbeddingLossSum  # noqa: E402
from st_ext.losses.gist import CachedGISTEmbedLoss, GISTEmbedLoss, GuideEmbeddings  # noqa: E402
from st_ext.losses.matryoshka import MatryoshkaLoss  # noqa: E402
from st_ext.losses.matryoshka_2d import Matryoshka2dLoss  # noqa: E402
from st_ext.losses.registry import build_loss, known_losses  # noqa: E402
from st_ext.losses.triplet import BatchAllTripletLoss, BatchHardTripletLoss, BatchSemiHardTripletLoss  # noqa: E402

ST_EXT_LOSSES = [
    "AdaptiveLayerLoss",
    "BatchAllTripletLoss",
    "BatchHardTripletLoss",
    "BatchSemiHardTripletLoss",
    "CachedMultipleNegativesRankingLoss",
    "CachedMultipleNegativesSymmetricRankingLoss",
    "CrossBatchMemoryLoss",
    "CachedGISTEmbedLoss",
    "DistillationLoss",
    "EmbeddingLossSum",
    "GISTEmbedLoss",
    "GuideEmbeddings",
    "Matryoshka2dLoss",
    "MatryoshkaLoss",
    "TeacherLabels",
    "build_loss",
    "known_losses",
]

__all__ = sorted(set(_UPSTREAM_NAMES) | set(ST_EXT_LOSSES))
