"""Batch-all, batch-hard and semi-hard triplet losses whose memory follows the distance matrix.

Same constructor, values and gradients as sentence-transformers' ``BatchAllTripletLoss``,
``BatchHardTripletLoss`` and ``BatchSemiHardTripletLoss``; in addition, reference rows from earlier
steps (a cross-batch memory) can join the batch's rows as positives and negatives. With B anchors and
R references (the batch, then the memory) nothing is larger than the B×R distance matrix, where
upstream builds B×B×B (4.x) or (positive pairs)×B (6.x) for batch-all and B²×B (4.x) for semi-hard,
and enumerating the triplets (PML's way) costs their number, which a memory makes enormous.

Anchor ``i`` is reference ``i``, never its own positive. Memory references are detached: gradients
reach the batch only.
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from sentence_transformers.util import cos_sim
from torch import Tensor, nn

from st_ext._compat import st_losses, upstream_triplet_distance
from st_ext.losses._signatures import named_like_upstream, upstream_default
from st_ext.mining import anchors_with_triplets, count_prefix, group_by_class, positive_pairs, rank_in_row

DistanceMetric = Callable[[Tensor], Tensor]
TripletLossFunction = Callable[[Tensor, Tensor, Tensor, float], Tensor]

if TYPE_CHECKING:  # upstream's losses as 6.x places them; at run time, the installed release's
    from sentence_transformers.sentence_transformer import losses as _upstream
else:
    _upstream = st_losses()


# ---------------------------------------------------------------------------------------------
# Distances from the anchors to the references


def euclidean_pairwise(anchors: Tensor, references: Tensor, squared: bool = False) -> Tensor:
    """``(B, R)`` L2 distances from each anchor to each reference; ``references[:B]`` are the anchors.

    ``|a|² - 2a·r + |r|²``, as upstream computes it, with the anchors' squared norms read off the
    product's diagonal: each anchor's distance to itself is then exactly zero, which the sqrt's
    gradient guard below relies on. Half precision is computed in float32 (6.x's rule).
    """
    batch_size = len(anchors)
    with torch.autocast(device_type=anchors.device.type, enabled=False):
        if anchors.dtype in (torch.float16, torch.bfloat16):
            anchors, references = anchors.float(), references.float()
        products = torch.matmul(anchors, references.t())
    anchor_norms = torch.diagonal(products[:, :batch_size])
    memory_norms = references[batch_size:].float().pow(2).sum(dim=1).to(products.dtype)
    reference_norms = torch.cat([anchor_norms, memory_norms]) if len(memory_norms) else anchor_norms
    distances = reference_norms.unsqueeze(0) - 2.0 * products + anchor_norms.unsqueeze(1)
    distances = distances.masked_fill(distances < 0, 0.0)
    if squared:
        return distances
    # sqrt has an infinite gradient at zero: shift exact zeros off it and zero their gradient.
    zero = distances.eq(0).to(distances.dtype)
    return (1.0 - zero) * torch.sqrt(distances + zero * 1e-16)


def cosine_pairwise(anchors: Tensor, references: Tensor) -> Tensor:
    """``(B, R)`` cosine distances (1 - cosine similarity) from each anchor to each reference."""
    return 1 - cos_sim(anchors, references)


def euclidean_distance(embeddings: Tensor, squared: bool = False) -> Tensor:
    """Pairwise L2 distances within a batch: upstream's ``euclidean_distance``, same values."""
    return euclidean_pairwise(embeddings, embeddings, squared=squared)


def cosine_distance(embeddings: Tensor) -> Tensor:
    """Pairwise cosine distances within a batch: upstream's ``cosine_distance``, same values."""
    return cosine_pairwise(embeddings, embeddings)


@functools.lru_cache(maxsize=1)
def known_pairwise_metrics() -> dict[Callable, Callable[[Tensor, Tensor], Tensor]]:
    """Batch metrics (st_ext's and upstream's, under every name the installed release defines) that
    have a B×R form, so a memory costs B×R rather than a full (B+M)×(B+M) matrix."""
    by_name: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
        "euclidean_distance": euclidean_pairwise,
        "eucledian_distance": euclidean_pairwise,
    }
    by_name["cosine_distance"] = cosine_pairwise
    metrics: dict[Callable, Callable[[Tensor, Tensor], Tensor]] = {
        euclidean_distance: euclidean_pairwise,
        cosine_distance: cosine_pairwise,
    }
    for name, pairwise in by_name.items():
        function = upstream_triplet_distance(name)
        if function is not None:
            metrics[function] = pairwise
    return metrics


def triplet_distances(
    distance_metric: DistanceMetric, embeddings: Tensor, memory_embeddings: Tensor | None = None
) -> Tensor:
    """``(B, B + M)`` distances from the batch to the batch followed by the (detached) memory.

    A metric without a known B×R form is called on the whole reference set and cut to the batch's
    rows: exact, but it costs (B+M)² (a warning says so when a memory is used).
    """
    if memory_embeddings is None or len(memory_embeddings) == 0:
        references = embeddings
    else:
        memory = memory_embeddings.detach().to(device=embeddings.device, dtype=embeddings.dtype)
        references = torch.cat([embeddings, memory])
    pairwise = known_pairwise_metrics().get(distance_metric)
    if pairwise is not None:
        return pairwise(embeddings, references)
    if references is not embeddings:
        warnings.warn(
            f"distance_metric {getattr(distance_metric, '__name__', distance_metric)!r} has no batch-to-memory "
            "form, so it is computed over batch + memory squared; use euclidean_distance or cosine_distance "
            "from st_ext.losses.triplet for B x (B + M) cost.",
            stacklevel=3,
        )
    return distance_metric(references)[: len(embeddings)]


# ---------------------------------------------------------------------------------------------
# The losses over a (B, R) distance matrix


def label_masks(distances: Tensor, labels: Tensor, ref_labels: Tensor) -> tuple[Tensor, Tensor]:
    """``same`` (B×R: the reference has the anchor's label) and ``positive`` (same, and not the
    anchor itself, which is reference ``i`` for anchor ``i``)."""
    same = labels.unsqueeze(1) == ref_labels.unsqueeze(0)
    is_self = torch.eye(len(labels), distances.shape[1], dtype=torch.bool, device=distances.device)
    return same, same & ~is_self


def float_margin(distances: Tensor, margin: float) -> float:
    """The margin as the distance dtype stores it: upstream adds it to a tensor of that dtype."""
    return float(torch.tensor(margin, dtype=distances.dtype))


def previous_float(value: float, dtype: torch.dtype) -> float:
    """The largest ``dtype`` value below ``value``: ``x <= previous`` is ``x < value`` in that dtype."""
    return float(torch.nextafter(torch.tensor(value, dtype=dtype), torch.tensor(-math.inf, dtype=dtype)))


def count_within(sorted_rows: Tensor, pair_row: Tensor, row_length: Tensor, value: Tensor, bound: float) -> Tensor:
    """Per pair: how many of its row's first ``row_length`` ascending entries ``x`` satisfy
    ``x - value <= bound``, exactly as that float expression evaluates.

    ``x - value`` never falls as ``x`` grows, so they are a prefix. Each row's pairs are laid out as
    a padded (rows, pairs) query matrix for :func:`st_ext.mining.count_prefix`, which guesses with
    ``searchsorted`` on ``value + bound`` and bisects the rare wrong guesses. Padding queries are
    -inf, where the (right) guess is 0.
    """
    rank, pairs_width = rank_in_row(pair_row, len(sorted_rows))
    queries = sorted_rows.new_full((len(sorted_rows), max(pairs_width, 1)), -math.inf)
    queries[pair_row, rank] = value
    guess = torch.searchsorted(sorted_rows, queries + bound, right=True)
    count = count_prefix(sorted_rows, queries, lambda x, query: x - query <= bound, guess)
    return torch.minimum(count[pair_row, rank], row_length)


class MarginPrefixes(NamedTuple):
    """Per (anchor, positive) pair, how many of the anchor's distance-sorted negatives have a loss
    term ``d(a, p) - d(a, n) + margin`` that is >= 0 (and so carries gradient) and > 0 (and so counts)."""

    anchors: Tensor
    pair_row: Tensor
    pair_positive: Tensor
    sorted_negatives: Tensor
    with_gradient: Tensor
    violating: Tensor
    num_negatives: Tensor


def margin_prefixes(distances: Tensor, labels: Tensor, ref_labels: Tensor, margin: float) -> MarginPrefixes | None:
    """Sort each anchor's negatives once and count each pair's prefix inside the margin.

    ``d(a, p) - d(a, n) + margin >= 0`` evaluates as ``d(a, n) - d(a, p) <= margin`` (float
    subtraction is antisymmetric, and a difference is zero only between equal values); ``> 0`` is
    the same test against the next float below the margin. None when no anchor has both a positive
    and a negative.
    """
    groups = group_by_class(labels, ref_labels)
    anchors, num_negatives = anchors_with_triplets(groups, self_reference=True)
    if len(anchors) == 0:
        return None
    same_class = groups.anchor_class[anchors].unsqueeze(1) == groups.ref_class.unsqueeze(0)
    sorted_negatives = distances[anchors].masked_fill(same_class, math.inf).sort(dim=1).values
    pair_row, pair_positive = positive_pairs(groups, anchors, exclude_self=True)
    sorted_rows = sorted_negatives.detach()
    positive_distance = distances.detach()[anchors[pair_row], pair_positive]
    row_length = num_negatives[pair_row]
    margin = float_margin(distances, margin)
    return MarginPrefixes(
        anchors,
        pair_row,
        pair_positive,
        sorted_negatives,
        with_gradient=count_within(sorted_rows, pair_row, row_length, positive_distance, margin),
        violating=count_within(
            sorted_rows, pair_row, row_length, positive_distance, previous_float(margin, distances.dtype)
        ),
        num_negatives=row_length,
    )


def batch_all_triplet_loss(distances: Tensor, labels: Tensor, ref_labels: Tensor, margin: float) -> Tensor:
    """Mean of ``relu(d(a, p) - d(a, n) + margin)`` over the triplets where it is positive.

    A pair's terms over its ``k`` nearest negatives sum to ``k·(d(a, p) + margin) - Σ d(a, n)``, a
    prefix sum of the sorted row (in float64, so the subtraction loses nothing), so no per-triplet
    tensor exists.
    """
    prefixes = margin_prefixes(distances, labels, ref_labels, margin)
    if prefixes is None:
        return distances.sum() * 0.0
    sorted_negatives = prefixes.sorted_negatives.double()
    running = torch.cat([sorted_negatives.new_zeros(len(sorted_negatives), 1), sorted_negatives.cumsum(dim=1)], dim=1)
    taken = prefixes.with_gradient
    nearest_sum = running[prefixes.pair_row, taken]
    positive_distance = distances[prefixes.anchors[prefixes.pair_row], prefixes.pair_positive].double()
    total = (taken * (positive_distance + float_margin(distances, margin)) - nearest_sum).sum()
    num_positive_triplets = int(prefixes.violating.sum())
    return (total / (num_positive_triplets + 1e-16)).to(distances.dtype)


def batch_all_triplet_counts(distances: Tensor, labels: Tensor, ref_labels: Tensor, margin: float) -> tuple[int, int]:
    """(valid triplets, triplets with a positive loss): what batch-all averages over, for reports."""
    prefixes = margin_prefixes(distances, labels, ref_labels, margin)
    if prefixes is None:
        return 0, 0
    return int(prefixes.num_negatives.sum()), int(prefixes.violating.sum())


def batch_hard_triplet_loss(distances: Tensor, labels: Tensor, ref_labels: Tensor, margin: float) -> Tensor:
    """Mean over anchors of ``relu(hardest positive - hardest negative + margin)``.

    An anchor without positives has a hardest positive of 0, and one without negatives a hardest
    negative of ``row max + row min``: upstream's masking arithmetic, kept for equal values.
    """
    same, positive = label_masks(distances, labels, ref_labels)
    hardest_positive = (positive.to(distances.dtype) * distances).max(dim=1, keepdim=True).values
    row_max = distances.max(dim=1, keepdim=True).values
    hardest_negative = (distances + row_max * same.to(distances.dtype)).min(dim=1, keepdim=True).values
    per_anchor = hardest_positive - hardest_negative + margin
    return per_anchor.masked_fill(per_anchor < 0, 0.0).mean()


def batch_semi_hard_triplet_loss(distances: Tensor, labels: Tensor, ref_labels: Tensor, margin: float) -> Tensor:
    """FaceNet's semi-hard loss: per positive pair, the nearest negative farther than the positive
    (else the anchor's farthest negative); mean of ``relu(d(a, p) - d(a, n) + margin)`` over pairs.
    One sort per anchor and one search per pair (6.x's method)."""
    same, positive = label_masks(distances, labels, ref_labels)
    sorted_negatives = distances.masked_fill(same, math.inf).sort(dim=1, stable=True).values
    first_farther = torch.searchsorted(
        sorted_negatives.detach().contiguous(), distances.detach().contiguous(), right=True
    )
    farther = sorted_negatives.gather(1, first_farther.clamp(max=distances.shape[1] - 1))
    # Upstream's masked maximum: the row minimum for an anchor without negatives.
    row_min = distances.min(dim=1, keepdim=True).values
    farthest = ((distances - row_min) * ~same).max(dim=1, keepdim=True).values + row_min
    semi_hard_negative = torch.where(torch.isfinite(farther), farther, farthest)
    pair_loss = (distances - semi_hard_negative + margin) * positive.to(distances.dtype)
    num_positive_pairs = positive.sum().to(distances.dtype)
    return torch.maximum(pair_loss, pair_loss.new_zeros(())).sum() / num_positive_pairs.clamp(min=1e-16)


# ---------------------------------------------------------------------------------------------
# Labels and the whole computation from embeddings


def check_triplet_labels(labels: Tensor | None, batch_size: int, loss_name: str) -> Tensor:
    """One class label per text, as a 1-D tensor, or an error that says how to provide them."""
    if labels is None:
        raise ValueError(
            f"{loss_name} needs a class label for every text, but the batch has no labels: give the dataset "
            "one text column and a 'label' column of class ids (at least two texts per class)."
        )
    if not isinstance(labels, Tensor):
        labels = torch.as_tensor(labels)
    if labels.numel() != batch_size:
        raise ValueError(
            f"{loss_name} expects {batch_size} labels (one per text), got {labels.numel()} with shape "
            f"{tuple(labels.shape)}."
        )
    return labels.reshape(-1)


def triplet_loss_from_embeddings(
    loss_function: TripletLossFunction,
    distance_metric: DistanceMetric,
    margin: float,
    embeddings: Tensor,
    labels: Tensor,
    memory_embeddings: Tensor | None = None,
    memory_labels: Tensor | None = None,
) -> Tensor:
    """``loss_function`` with the batch as anchors and the batch followed by the memory as references."""
    ref_labels = labels
    if memory_embeddings is not None and len(memory_embeddings):
        if memory_labels is None or len(memory_labels) != len(memory_embeddings):
            raise ValueError("memory_embeddings need memory_labels, one per row.")
        ref_labels = torch.cat([labels, memory_labels.to(device=labels.device, dtype=labels.dtype)])
    distances = triplet_distances(distance_metric, embeddings, memory_embeddings)
    return loss_function(distances, labels.to(distances.device), ref_labels.to(distances.device), margin)


#: Upstream's default distance: the same function object, so that ``distance_metric`` defaults
#: (and the model card's ``distance_metric`` name) are upstream's on every release.
UPSTREAM_EUCLIDEAN = upstream_default(_upstream.BatchAllTripletLoss, "distance_metric")

# Shared by the three classes' docstrings after their own summary ({name}: the class).
_COMMON_DOC = """
    Args:
        model: the SentenceTransformer being trained.
        distance_metric: a function from a batch of embeddings to their pairwise distances;
            upstream's ``BatchHardTripletLossDistanceFunction`` functions and st_ext's
            ``euclidean_distance``/``cosine_distance`` cost B x (B + memory) with a memory.
            Default: upstream's Euclidean distance.
        margin: the margin between the positive and the negative distance (default 5).

    References:
        - In Defense of the Triplet Loss for Person Re-Identification: https://huggingface.co/papers/1703.07737
        - FaceNet (semi-hard negatives): https://huggingface.co/papers/1503.03832
        - Cross-batch memory (:class:`st_ext.losses.CrossBatchMemoryLoss`): https://huggingface.co/papers/1912.06798

    Inputs:
        +------------------+--------------------------------------------------+
        | Texts            | Labels                                           |
        +==================+==================================================+
        | single sentences | class (an integer per text, at least two texts   |
        |                  | per class in a batch; use the GROUP_BY_LABEL     |
        |                  | batch sampler)                                   |
        +------------------+--------------------------------------------------+

    Example:
        ::

            from datasets import Dataset
            from st_ext import SentenceTransformer, SentenceTransformerTrainer, losses

            model = SentenceTransformer("sentence-transformers/all-MiniLM-L6-v2")
            train_dataset = Dataset.from_dict({
                "sentence": ["He played a great game.", "The stock is up 20%", "They won 2-1.", "The last goal was amazing."],
                "label": [1, 0, 1, 1],
            })
            loss = losses.{name}(model)
            # with a memory of earlier batches' embeddings as extra positives and negatives:
            # loss = losses.CrossBatchMemoryLoss(model, losses.{name}(model), memory_size=4096)
            SentenceTransformerTrainer(model=model, train_dataset=train_dataset, loss=loss).train()
"""


class _BatchTripletLoss(nn.Module):
    """What the three losses share: the upstream constructor, forward, and a memory-aware entry point."""

    loss_function: TripletLossFunction

    def __init__(
        self, model: nn.Module, distance_metric: DistanceMetric = UPSTREAM_EUCLIDEAN, margin: float = 5
    ) -> None:
        super().__init__()
        self.model = model
        self.distance_metric = distance_metric
        self.margin = margin

    @property
    def sentence_embedder(self) -> nn.Module:
        """Upstream's name for the model (the trainer looks for ``model`` to swap in a DDP wrapper)."""
        return self.model

    @property
    def triplet_margin(self) -> float:
        """Upstream's name for the margin in the batch-all and batch-hard losses."""
        return self.margin

    @triplet_margin.setter
    def triplet_margin(self, value: float) -> None:
        self.margin = value

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor) -> Tensor:
        embeddings = self.model(list(sentence_features)[0])["sentence_embedding"]
        return self.compute_loss_from_embeddings([embeddings], labels)

    def compute_loss_from_embeddings(
        self,
        embeddings: Sequence[Tensor],
        labels: Tensor,
        memory_embeddings: Tensor | None = None,
        memory_labels: Tensor | None = None,
    ) -> Tensor:
        """The loss with ``embeddings[0]`` as anchors; ``memory_*`` (detached) extend the references."""
        anchors = embeddings[0]
        labels = check_triplet_labels(labels, len(anchors), type(self).__name__)
        return triplet_loss_from_embeddings(
            type(self).loss_function,
            self.distance_metric,
            self.margin,
            anchors,
            labels,
            memory_embeddings,
            memory_labels,
        )

    def get_config_dict(self) -> dict[str, Any]:
        """Upstream's card entries (hidden where upstream's class has no config, as on 4.x)."""
        return {
            "distance_metric": getattr(self.distance_metric, "__name__", str(self.distance_metric)),
            "margin": self.margin,
        }


@named_like_upstream(_upstream.BatchAllTripletLoss)
class BatchAllTripletLoss(_BatchTripletLoss):
    __doc__ = """Upstream's ``BatchAllTripletLoss`` (same arguments, values, gradients and card) in O(B x R) memory.

    Every valid triplet of the batch counts: anchor and positive share a label, the negative has
    another; the loss is the mean of ``relu(d(a, p) - d(a, n) + margin)`` over the triplets where
    it is positive. Upstream builds a B x B x B (4.x) or pairs x B (6.x) tensor; here each anchor's
    negatives are sorted once and each pair's sum is a prefix sum, so nothing exceeds B x R.
""" + _COMMON_DOC.replace("{name}", "BatchAllTripletLoss")

    loss_function = staticmethod(batch_all_triplet_loss)


@named_like_upstream(_upstream.BatchHardTripletLoss)
class BatchHardTripletLoss(_BatchTripletLoss):
    __doc__ = """Upstream's ``BatchHardTripletLoss`` (same arguments, values, gradients and card).

    Per anchor, its farthest positive and its nearest negative form the triplet; the loss is the
    mean over anchors of ``relu(d(a, p_hardest) - d(a, n_hardest) + margin)``.
""" + _COMMON_DOC.replace("{name}", "BatchHardTripletLoss")

    loss_function = staticmethod(batch_hard_triplet_loss)


@named_like_upstream(_upstream.BatchSemiHardTripletLoss)
class BatchSemiHardTripletLoss(_BatchTripletLoss):
    __doc__ = """Upstream's ``BatchSemiHardTripletLoss`` (same arguments, values, gradients and card) without 4.x's
    B^2 x B tiling.

    Per positive pair, the negative is the nearest one that is farther than the positive (else the
    anchor's farthest negative); the loss is the mean of ``relu(d(a, p) - d(a, n) + margin)``.
""" + _COMMON_DOC.replace("{name}", "BatchSemiHardTripletLoss")

    loss_function = staticmethod(batch_semi_hard_triplet_loss)


def triplet_settings(loss: nn.Module) -> tuple[TripletLossFunction, DistanceMetric, float] | None:
    """(loss function, distance metric, margin) of a triplet loss, st_ext's or upstream's, or of a subclass that
    keeps the upstream class's computation (``BatchHardSoftMarginTripletLoss`` overrides it: another loss);
    else None."""
    if isinstance(loss, _BatchTripletLoss):
        return type(loss).loss_function, loss.distance_metric, loss.margin
    upstream = st_losses()
    for upstream_class, function, margin_name in (
        (upstream.BatchAllTripletLoss, batch_all_triplet_loss, "triplet_margin"),
        (upstream.BatchHardTripletLoss, batch_hard_triplet_loss, "triplet_margin"),
        (upstream.BatchSemiHardTripletLoss, batch_semi_hard_triplet_loss, "margin"),
    ):
        if isinstance(loss, upstream_class) and not _overrides_computation(type(loss), upstream_class):
            return function, loss.distance_metric, getattr(loss, margin_name)
    return None


def _overrides_computation(loss_class: type, upstream_class: type) -> bool:
    """Whether ``loss_class`` replaces a method of ``upstream_class`` other than its constructor and card."""
    return any(
        callable(method) and inspect.getattr_static(loss_class, name) is not method
        for name, method in vars(upstream_class).items()
        if name not in ("__init__", "get_config_dict")
    )
