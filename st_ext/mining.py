"""Triplet indices and margin mining whose cost follows the number of triplets, not B×M×M.

pytorch-metric-learning's ``get_all_triplets_indices`` multiplies a B×M "same label" mask by a
B×M "different label" mask into a B×M×M tensor and calls ``torch.where`` on it: about 2.4 GiB
and seconds of work for a batch of 21 against a memory of 10,000 (100 classes), and a Python
loop per anchor once B·M·M passes INT_MAX. Its ``TripletMarginMiner`` then gathers two
distances for every triplet of that full set before filtering. Here the same triplets come
from three steps:

1. Group the reference indices by label with one stable sort. An anchor's positives are then a
   contiguous run of that order and its negatives the complement of its class, both ascending.
2. List the (anchor, positive) pairs: at most B·M of them, usually far fewer.
3. Every triplet is a pair followed by one entry of a contiguous segment of a source list: the
   negatives of the anchor's class, or for the miner the run of the anchor's distance-sorted
   negatives that falls in the margin window (found with ``searchsorted``). The segments are
   written straight into the three int64 output columns with running sums of sparse jumps, so
   the output is the only large allocation.

This module imports nothing from st_ext, so that losses can build on it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import NamedTuple

import torch

TRIPLET_TYPES = ("all", "hard", "semihard", "easy")
DISTANCES = ("euclidean", "cosine")

# Below this many B·M·M elements a dense mask is faster than the grouped expansion, whose fixed
# cost is a few dozen small tensor ops (crossover measured by benchmarks/bench_mining.py).
DENSE_MAX_ELEMENTS = 2**18

# Copy runs of negatives by their jumps (no gather, no scratch index) while there are fewer than
# one jump per this many triplets; above, the jump list itself would cost real memory.
REPEATED_RUNS_MAX_JUMP_SHARE = 16

Triplets = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class ClassGroups(NamedTuple):
    """Reference indices grouped by class: class ``c`` is ``order[start[c] : start[c] + size[c]]``."""

    anchor_class: torch.Tensor
    ref_class: torch.Tensor
    order: torch.Tensor
    start: torch.Tensor
    size: torch.Tensor


# ---------------------------------------------------------------------------------------------
# Input checks


def check_labels(labels, name: str = "labels") -> torch.Tensor:
    """Reject labels that would silently give wrong triplets: not a tensor, not 1-D, or NaN (which,
    never equal to itself, would be nobody's positive and everybody's negative)."""
    if not isinstance(labels, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor, got {type(labels).__name__}; convert it with torch.as_tensor({name})."
        )
    if labels.ndim != 1:
        raise ValueError(
            f"{name} must be 1-D (one class label per embedding), got shape {tuple(labels.shape)}; "
            f"flatten it, or pass one label per row."
        )
    if labels.is_complex():
        raise TypeError(f"{name} must hold real class labels, got dtype {labels.dtype}.")
    if labels.is_floating_point() and torch.isnan(labels).any():
        raise ValueError(f"{name} contains NaN; every sample needs a class label that equals itself.")
    return labels


# ---------------------------------------------------------------------------------------------
# Grouping and pairs


def group_by_class(labels: torch.Tensor, ref_labels: torch.Tensor) -> ClassGroups:
    """Dense class ids for both label sets, and the reference indices sorted by class.

    A stable sort keeps indices ascending inside each class, which is what makes positives (and,
    by complement, negatives) come out in the same ascending order as PML's ``torch.where``.
    """
    unique_labels, class_ids = torch.unique(torch.cat([labels, ref_labels]), return_inverse=True)
    anchor_class, ref_class = class_ids[: len(labels)], class_ids[len(labels) :]
    order = torch.sort(ref_class, stable=True).indices
    size = torch.bincount(ref_class, minlength=len(unique_labels))
    return ClassGroups(anchor_class, ref_class, order, exclusive_cumsum(size), size)


def ragged_arange(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``cat([arange(s, s + n) for s, n in zip(starts, lengths)])`` without a Python loop."""
    out = torch.empty(int(lengths.sum()), dtype=torch.int64, device=starts.device)
    keep = lengths > 0
    starts, lengths = starts[keep], lengths[keep]
    fill_ragged_arange(out, exclusive_cumsum(lengths), starts, lengths)
    return out


def exclusive_cumsum(counts: torch.Tensor) -> torch.Tensor:
    """Offset of each block when blocks of these sizes are laid end to end."""
    return torch.cumsum(counts, 0) - counts


def anchors_with_triplets(groups: ClassGroups, self_reference: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors that have at least one positive and one negative, and their negative counts.

    The rest (e.g. anchors whose class is missing from a memory bank) cost nothing further.
    """
    class_size = groups.size[groups.anchor_class]
    num_positives = class_size - int(self_reference)
    num_negatives = len(groups.ref_class) - class_size
    anchors = torch.nonzero((num_positives > 0) & (num_negatives > 0)).squeeze(1)
    return anchors, num_negatives[anchors]


def positive_pairs(
    groups: ClassGroups, anchors: torch.Tensor, exclude_self: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """All (anchor, positive) pairs of the given anchors, by anchor then ascending positive.

    Returns each pair's row in ``anchors`` and its positive's reference index. ``exclude_self``
    drops the anchor itself, which is in its own class when the batch is its own reference.
    """
    anchor_class = groups.anchor_class[anchors]
    class_size = groups.size[anchor_class]
    pair_row = torch.repeat_interleave(torch.arange(len(anchors), device=anchors.device), class_size)
    pair_positive = groups.order[ragged_arange(groups.start[anchor_class], class_size)]
    if exclude_self:
        not_self = pair_positive != anchors[pair_row]
        pair_row, pair_positive = pair_row[not_self], pair_positive[not_self]
    return pair_row, pair_positive


# ---------------------------------------------------------------------------------------------
# Expanding (pair, segment) blocks into triplet columns


def fill_piecewise_constant(out: torch.Tensor, block_offsets: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values[i]`` over block ``i`` of ``out`` (blocks start at ``block_offsets``, sorted).

    A running sum of the jumps between consecutive values touches ``out`` twice and allocates
    nothing of its size, unlike ``repeat_interleave``, which builds an index as long as ``out``.
    """
    if len(out) == 0:
        return
    out.zero_()
    jumps = torch.diff(values, prepend=values.new_zeros(1))
    out[block_offsets] = jumps
    out.cumsum_(0)


def fill_ragged_arange(
    out: torch.Tensor, block_offsets: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor
) -> None:
    """Write ``starts[i], starts[i] + 1, ...`` over block ``i`` of ``out`` (blocks non-empty, sorted).

    Same running-sum trick: steps of one, and at each block start the jump from where the previous
    block ended to where this one begins.
    """
    if len(out) == 0:
        return
    out.fill_(1)
    jumps = starts.clone()
    jumps[1:] -= starts[:-1] + lengths[:-1] - 1
    out[block_offsets] = jumps
    out.cumsum_(0)


class RunJumps(NamedTuple):
    """Where runs of a source list step by other than +1: run ``r``'s jumps are entries
    ``start[r] : start[r] + jump_count[r]``, each at ``offset`` inside the run, stepping by ``step``."""

    jump_count: torch.Tensor
    start: torch.Tensor
    offset: torch.Tensor
    step: torch.Tensor


def run_jumps(source: torch.Tensor, run_start: torch.Tensor) -> RunJumps:
    """The non-unit steps inside each run of ``source`` (runs laid end to end, none empty).

    A list of negatives is mostly consecutive indices, broken only where members of the class are
    skipped, so a run is described by far fewer jumps than it has entries.
    """
    steps = torch.diff(source, prepend=source.new_zeros(1))
    inside_a_run = torch.ones_like(source, dtype=torch.bool)
    inside_a_run[run_start] = False
    positions = torch.nonzero((steps != 1) & inside_a_run).squeeze(1)
    run_of_position = torch.searchsorted(run_start, positions, right=True) - 1
    count = torch.bincount(run_of_position, minlength=len(run_start))
    return RunJumps(count, exclusive_cumsum(count), positions - run_start[run_of_position], steps[positions])


def fill_repeated_runs(
    out: torch.Tensor,
    block_offsets: torch.Tensor,
    block_run: torch.Tensor,
    source: torch.Tensor,
    run_start: torch.Tensor,
    run_length: torch.Tensor,
    jumps: RunJumps,
) -> None:
    """Write run ``block_run[i]`` of ``source`` over block ``i`` of ``out`` without a gather.

    Running sum of steps of one, plus each run's jumps and the jump between consecutive blocks:
    two passes over ``out`` and no index as long as it (which a gather would need).
    """
    if len(out) == 0:
        return
    out.fill_(1)
    first = source[run_start[block_run]]
    last = source[run_start[block_run] + run_length[block_run] - 1]
    block_jump = first.clone()
    block_jump[1:] -= last[:-1]
    out[block_offsets] = block_jump
    jumps_per_block = jumps.jump_count[block_run]
    jump = ragged_arange(jumps.start[block_run], jumps_per_block)
    out[torch.repeat_interleave(block_offsets, jumps_per_block) + jumps.offset[jump]] = jumps.step[jump]
    out.cumsum_(0)


def gather_segments(
    out: torch.Tensor,
    scratch: torch.Tensor,
    block_offsets: torch.Tensor,
    source: torch.Tensor,
    segment_start: torch.Tensor,
    segment_length: torch.Tensor,
) -> None:
    """Write ``source[segment_start[i] : segment_start[i] + segment_length[i]]`` over block ``i``,
    gathering through an index built in ``scratch`` (a buffer as long as ``out``)."""
    fill_ragged_arange(scratch, block_offsets, segment_start, segment_length)
    torch.index_select(source, 0, scratch, out=out)


def expand_blocks(
    block_anchor: torch.Tensor,
    block_constant: torch.Tensor,
    block_length: torch.Tensor,
    write_varying: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
) -> Triplets:
    """Columns (anchor, constant, varying) for blocks of ``block_length[i]`` triplets that share
    an anchor and one more index (the positive for all triplets, the negative when mining).

    ``write_varying(column, scratch, block_offsets)`` fills the third column; the anchor column
    is its scratch space before it receives the anchors, so peak memory is the three output
    columns plus per-block bookkeeping. Blocks must be non-empty.
    """
    block_offsets = exclusive_cumsum(block_length)
    total = int(block_length.sum())
    device = block_anchor.device
    anchors = torch.empty(total, dtype=torch.int64, device=device)
    constants = torch.empty(total, dtype=torch.int64, device=device)
    varying = torch.empty(total, dtype=torch.int64, device=device)
    if total:
        write_varying(varying, anchors, block_offsets)
        fill_piecewise_constant(anchors, block_offsets, block_anchor)
        fill_piecewise_constant(constants, block_offsets, block_constant)
    return anchors, constants, varying


def _empty_triplets(device: torch.device) -> Triplets:
    """Three empty int64 index tensors, the shape PML returns when there is nothing to mine."""
    empty = torch.empty(0, dtype=torch.int64, device=device)
    return empty, empty.clone(), empty.clone()


# ---------------------------------------------------------------------------------------------
# All triplets


def dense_triplets_indices(labels: torch.Tensor, ref_labels: torch.Tensor, self_reference: bool) -> Triplets:
    """All triplets from a B×M×M mask: for tiny inputs only, where a handful of tensor ops beat
    the grouped path's fixed cost. ``torch.where`` yields them in (a, p, n) order.

    The mask is a uint8 product: about 1.5× faster than ``&`` on bool masks here (measured).
    """
    same = (labels.unsqueeze(1) == ref_labels.unsqueeze(0)).to(torch.uint8)
    different = 1 - same
    if self_reference:
        same.fill_diagonal_(0)
    anchors, positives, negatives = torch.where(same.unsqueeze(2) * different.unsqueeze(1))
    return anchors, positives, negatives


def all_triplets_indices(labels: torch.Tensor, ref_labels: torch.Tensor | None = None) -> Triplets:
    """Every (anchor, positive, negative) triplet: the same tensors, in the same order, as PML's
    ``get_all_triplets_indices`` (2.9.0).

    ``labels`` (B) label the anchors, ``ref_labels`` (M) the positives and negatives. When
    ``ref_labels`` is None, or is the very same tensor object as ``labels`` (PML's rule), the batch
    is its own reference and an anchor is never its own positive. Triplets are ordered by anchor,
    then positive, then negative, ascending; all three are int64 on the labels' device.

    Time and memory are O(B·M + number of triplets): no B×M×M mask, no per-anchor loop, and no
    INT_MAX limit. Only tiny inputs (B·M·M up to ``DENSE_MAX_ELEMENTS``) take the dense mask,
    which is faster there.
    """
    self_reference = ref_labels is None or ref_labels is labels
    labels = check_labels(labels)
    ref_labels = labels if ref_labels is None else check_labels(ref_labels, "ref_labels")
    if labels.device != ref_labels.device:
        raise ValueError(
            f"labels are on {labels.device} but ref_labels on {ref_labels.device}; move both to the same device."
        )
    if len(labels) == 0 or len(ref_labels) == 0:
        return _empty_triplets(labels.device)

    if len(labels) * len(ref_labels) ** 2 <= DENSE_MAX_ELEMENTS:
        return dense_triplets_indices(labels, ref_labels, self_reference)
    return grouped_triplets_indices(labels, ref_labels, self_reference)


def grouped_triplets_indices(labels: torch.Tensor, ref_labels: torch.Tensor, self_reference: bool) -> Triplets:
    """All triplets by the three steps of the module docstring, in (a, p, n) order.

    Each (anchor, positive) pair is followed by the negatives of its anchor's class: one run of a
    flat list shared by all anchors of that class. Runs are copied by their jumps when those are
    few (many classes, the usual case) and gathered otherwise (a class covering much of the
    memory, whose negatives skip around).
    """
    groups = group_by_class(labels, ref_labels)
    anchors, num_negatives = anchors_with_triplets(groups, self_reference)
    if len(anchors) == 0:
        return _empty_triplets(labels.device)

    pair_row, pair_positive = positive_pairs(groups, anchors, exclude_self=self_reference)
    # The negatives of each anchor class, laid end to end: (anchor classes)·M <= B·M entries.
    num_ref = len(ref_labels)
    classes, class_of_row = torch.unique(groups.anchor_class[anchors], return_inverse=True)
    is_negative = groups.ref_class.unsqueeze(0) != classes.unsqueeze(1)
    negatives = torch.arange(num_ref, device=labels.device).expand(len(classes), num_ref)[is_negative]
    run_length = num_ref - groups.size[classes]
    run_start = exclusive_cumsum(run_length)
    jumps = run_jumps(negatives, run_start)
    block_run = class_of_row[pair_row]
    block_length = run_length[block_run]
    few_jumps = int(jumps.jump_count[block_run].sum()) <= int(block_length.sum()) // REPEATED_RUNS_MAX_JUMP_SHARE

    def write(out: torch.Tensor, scratch: torch.Tensor, block_offsets: torch.Tensor) -> None:
        if few_jumps:
            fill_repeated_runs(out, block_offsets, block_run, negatives, run_start, run_length, jumps)
        else:
            gather_segments(out, scratch, block_offsets, negatives, run_start[block_run], block_length)

    return expand_blocks(anchors[pair_row], pair_positive, block_length, write)


# ---------------------------------------------------------------------------------------------
# Margin mining


def distance_matrix(
    embeddings: torch.Tensor, ref_emb: torch.Tensor, distance: str | Callable
) -> tuple[torch.Tensor, bool]:
    """The B×M matrix the margin is measured on, and whether larger means closer (a similarity).

    "euclidean" is PML's default ``LpDistance()`` (L2 distance of L2-normalised embeddings),
    "cosine" its ``CosineSimilarity()``; both are computed the way PML computes them so that margin
    comparisons agree bit for bit. A callable (e.g. a PML distance object) is called as
    ``distance(embeddings, ref_emb)`` and read for an ``is_inverted`` attribute.
    Half precision is computed in float32, since ``cdist`` has no half kernel on every device.
    """
    if callable(distance):
        return distance(embeddings, ref_emb), bool(getattr(distance, "is_inverted", False))
    if embeddings.dtype in (torch.float16, torch.bfloat16):
        embeddings, ref_emb = embeddings.float(), ref_emb.float()
    query = torch.nn.functional.normalize(embeddings, p=2, dim=1)
    ref = torch.nn.functional.normalize(ref_emb, p=2, dim=1)
    if distance == "euclidean":
        return torch.cdist(query, ref, p=2), False
    return torch.matmul(query, ref.transpose(-1, -2)), True


def margin_window(type_of_triplets: str, margin: float) -> tuple[float | None, float | None]:
    """Bounds (lower, upper) on ``an - ap`` that PML's triplet types select, as count boundaries.

    A triplet is kept when ``lower < an - ap <= upper`` (None: unbounded). PML's "hard" is
    ``<= margin`` and ``<= 0``; "semihard" ``> 0`` and ``<= margin``; "easy" ``> margin``.
    """
    return {
        "all": (None, margin),
        "hard": (None, min(margin, 0.0)),
        "semihard": (0.0, margin),
        "easy": (margin, None),
    }[type_of_triplets]


def rank_in_row(pair_row: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, int]:
    """Each pair's position among the pairs of its row (pairs sorted by row), and the widest row.

    Lays per-anchor lists of varying length out as a padded (rows, width) matrix, e.g. of queries
    for one batched ``searchsorted`` and :func:`count_prefix` (the triplet losses do so too).
    """
    pairs_per_row = torch.bincount(pair_row, minlength=num_rows)
    rank = torch.arange(len(pair_row), device=pair_row.device) - exclusive_cumsum(pairs_per_row)[pair_row]
    return rank, int(pairs_per_row.max()) if num_rows else 0


def count_prefix(
    sorted_rows: torch.Tensor,
    queries: torch.Tensor,
    passes: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    guess: torch.Tensor,
) -> torch.Tensor:
    """For each query (a K×Q matrix, one row of queries per sorted row): how many leading values
    of its row satisfy ``passes(value, query)``, a float test that holds on a prefix of the row.

    ``guess`` comes from ``searchsorted`` on a threshold, which rounds differently from the test
    itself (PML's ``an - ap`` against the margin) and can be off next to the boundary. The guess
    is right iff the value before it passes and the value at it fails; the few entries where that
    check fails get an exact bisection, so the count is exactly what PML's test decides.
    """
    width = sorted_rows.shape[1]
    count = guess.clamp(max=width)
    before = sorted_rows.gather(1, (count - 1).clamp(min=0))
    at = sorted_rows.gather(1, count.clamp(max=width - 1))
    right = ((count == 0) | passes(before, queries)) & ((count == width) | ~passes(at, queries))
    wrong = torch.nonzero(~right.reshape(-1)).squeeze(1)
    if len(wrong) == 0:
        return count
    row = torch.div(wrong, queries.shape[1], rounding_mode="floor")
    query = queries.reshape(-1)[wrong]
    low, high = torch.zeros_like(row), torch.full_like(row, width)
    for _ in range(math.ceil(math.log2(width + 1))):
        middle = (low + high) // 2
        ok = passes(sorted_rows[row, middle.clamp(max=width - 1)], query)
        active = low < high
        low = torch.where(active & ok, middle + 1, low)
        high = torch.where(active & ~ok, middle, high)
    count.view(-1)[wrong] = low
    return count


def mine_dense(
    oriented: torch.Tensor,
    labels: torch.Tensor,
    ref_labels: torch.Tensor,
    self_reference: bool,
    lower: float | None,
    upper: float | None,
) -> Triplets:
    """Keep the triplets with ``lower < an - ap <= upper`` out of the full list: for tiny inputs,
    where listing everything is the faster way. ``oriented`` is a distance-like B×M matrix."""
    anchors, positives, negatives = dense_triplets_indices(labels, ref_labels, self_reference)
    margin_term = oriented[anchors, negatives] - oriented[anchors, positives]
    keep = torch.ones_like(margin_term, dtype=torch.bool)
    if lower is not None:
        keep &= margin_term > lower
    if upper is not None:
        keep &= margin_term <= upper
    return anchors[keep], positives[keep], negatives[keep]


def mine_grouped(
    oriented: torch.Tensor,
    labels: torch.Tensor,
    ref_labels: torch.Tensor,
    self_reference: bool,
    lower: float | None,
    upper: float | None,
) -> Triplets:
    """The triplets with ``lower < an - ap <= upper``, at a cost of O(B·M·log(positives) + mined).

    Each anchor's positives are sorted by distance once (they are the small side: one class
    against all others). For a fixed (anchor, negative), ``an - ap`` falls as ``ap`` grows, so the
    kept positives are one contiguous run of that order, bounded by two counts
    (:func:`count_prefix`), and only the non-empty runs are expanded.
    """
    groups = group_by_class(labels, ref_labels)
    anchors, _ = anchors_with_triplets(groups, self_reference)
    if len(anchors) == 0:
        return _empty_triplets(oriented.device)

    pair_row, pair_positive = positive_pairs(groups, anchors, exclude_self=self_reference)
    an = oriented[anchors]
    is_negative = groups.anchor_class[anchors].unsqueeze(1) != groups.ref_class.unsqueeze(0)
    # Each anchor's positive distances ascending (padded with +inf), and the positive in each slot.
    rank, width = rank_in_row(pair_row, len(anchors))
    padded_ap = an.new_full((len(anchors), width), math.inf)
    padded_ap[pair_row, rank] = oriented[anchors[pair_row], pair_positive]
    padded_positive = torch.zeros((len(anchors), width), dtype=torch.int64, device=an.device)
    padded_positive[pair_row, rank] = pair_positive
    sorted_ap, slot = torch.sort(padded_ap, dim=1)
    positive_in_slot = padded_positive.gather(1, slot)

    def count(bound: float) -> torch.Tensor:
        """Per (anchor, negative): how many of the anchor's sorted ap give ``an - ap > bound``."""
        guess = torch.searchsorted(sorted_ap, an - bound)
        return count_prefix(sorted_ap, an, lambda ap_value, an_value: an_value - ap_value > bound, guess)

    num_positives = torch.bincount(pair_row, minlength=len(anchors)).unsqueeze(1)
    first = torch.zeros_like(an, dtype=torch.int64) if upper is None else count(upper)
    end = num_positives.expand_as(an) if lower is None else count(lower)
    row, negative = torch.nonzero(is_negative & (end > first), as_tuple=True)
    first, length = first[row, negative], end[row, negative] - first[row, negative]
    slot_start = row * sorted_ap.shape[1] + first

    def write(out: torch.Tensor, scratch: torch.Tensor, block_offsets: torch.Tensor) -> None:
        gather_segments(out, scratch, block_offsets, positive_in_slot.reshape(-1), slot_start, length)

    block_anchors, negatives, positives = expand_blocks(anchors[row], negative, length, write)
    return block_anchors, positives, negatives


def _check_embeddings(embeddings, labels: torch.Tensor, name: str, labels_name: str) -> None:
    if not isinstance(embeddings, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(embeddings).__name__}.")
    if embeddings.ndim != 2:
        raise ValueError(f"{name} must be 2-D (batch_size, embedding_size), got shape {tuple(embeddings.shape)}.")
    if len(embeddings) != len(labels):
        raise ValueError(
            f"{name} has {len(embeddings)} rows but {labels_name} has {len(labels)} entries; "
            f"pass one label per embedding."
        )


class TripletMarginMiner(torch.nn.Module):
    """Triplets that violate (or, for "easy", satisfy) a margin: the same set as PML's
    ``TripletMarginMiner`` (2.9.0), at a cost that follows the number of triplets mined.

    With ``d`` a distance, the margin term is ``d(a, n) - d(a, p)``; with a similarity (``cosine``)
    it is ``s(a, p) - s(a, n)``. "all" keeps terms ``<= margin``, "hard" those also ``<= 0``,
    "semihard" those also ``> 0``, "easy" those ``> margin``.

    See :func:`mine_grouped` for how. Triplets come grouped by anchor, but not in PML's order
    (tiny inputs aside), so compare results as sets. Half-precision embeddings are measured in
    float32.
    """

    def __init__(
        self,
        margin: float = 0.2,
        type_of_triplets: str = "all",
        distance: str | Callable = "euclidean",
    ):
        super().__init__()
        if isinstance(margin, bool) or not isinstance(margin, numbers.Real) or not math.isfinite(margin):
            raise TypeError(f"margin must be a finite real number, got {margin!r}.")
        if type_of_triplets not in TRIPLET_TYPES:
            raise ValueError(f"type_of_triplets must be one of {TRIPLET_TYPES}, got {type_of_triplets!r}.")
        if isinstance(distance, str) and distance not in DISTANCES:
            raise ValueError(
                f"distance must be one of {DISTANCES} or a callable returning a (B, M) matrix, got {distance!r}."
            )
        if not isinstance(distance, str) and not callable(distance):
            raise TypeError(f"distance must be a name or a callable, got {type(distance).__name__}.")
        self.margin: float = float(margin)
        self.type_of_triplets: str = type_of_triplets
        self.distance: str | Callable = distance

    def extra_repr(self) -> str:
        return f"margin={self.margin}, type_of_triplets={self.type_of_triplets!r}, distance={self.distance!r}"

    def forward(
        self,
        embeddings: torch.Tensor,
        labels: torch.Tensor,
        ref_emb: torch.Tensor | None = None,
        ref_labels: torch.Tensor | None = None,
    ) -> Triplets:
        """(anchor_idx, positive_idx, negative_idx), int64; indices into ``embeddings`` and, for
        positives and negatives, into ``ref_emb`` (``embeddings`` itself when not given).

        As in PML, an anchor is never its own positive when ``ref_emb`` is not given or
        ``ref_labels`` is the very same tensor as ``labels``.
        """
        labels = check_labels(labels)
        _check_embeddings(embeddings, labels, "embeddings", "labels")
        if (ref_emb is None) != (ref_labels is None):
            raise ValueError(
                "ref_emb and ref_labels go together: pass both (e.g. a memory bank and its labels) "
                "or neither (the batch is its own reference)."
            )
        self_reference = ref_emb is None or ref_labels is labels
        if ref_emb is None:
            ref_emb, ref_labels = embeddings, labels
        else:
            ref_labels = check_labels(ref_labels, "ref_labels")
            _check_embeddings(ref_emb, ref_labels, "ref_emb", "ref_labels")
            if ref_emb.shape[1] != embeddings.shape[1]:
                raise ValueError(
                    f"ref_emb rows have size {ref_emb.shape[1]} but embeddings rows {embeddings.shape[1]}; "
                    f"both must come from the same model."
                )
        if len(labels) == 0 or len(ref_labels) == 0:
            return _empty_triplets(embeddings.device)
        with torch.no_grad():
            labels = labels.to(embeddings.device)
            ref_labels = labels if self_reference else ref_labels.to(embeddings.device)
            matrix, is_similarity = distance_matrix(embeddings, ref_emb, self.distance)
            if not torch.isfinite(matrix).all():
                raise ValueError("the distance matrix contains NaN or inf; check the embeddings for NaN/inf values.")
            # Negated similarities turn "ap - an" into "an' - ap'" with identical rounding.
            oriented = -matrix if is_similarity else matrix
            lower, upper = margin_window(self.type_of_triplets, self.margin)
            mine = mine_dense if len(labels) * len(ref_labels) ** 2 <= DENSE_MAX_ELEMENTS else mine_grouped
            return mine(oriented, labels, ref_labels, self_reference, lower, upper)
