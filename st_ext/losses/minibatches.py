"""One batch's mini-batches, planned once on the host: which rows of which columns each forward pass embeds.

GradCache embeds a batch one mini-batch at a time, twice (without a graph, then with one). What
decides its speed on an accelerator is how many forward passes it launches, how much padding
each carries, and whether the host waits for the device between them. So the plan is made once
per batch, before any forward pass, from one copy of each column's per-row facts
(:class:`ColumnLayout`), and never looks at device data again:

* **Merged columns.** When the columns can share a forward pass (same feature keys and metadata,
  padding on the right or flattened rows), the batch is one sequence of rows, column after column,
  cut into mini-batches of ``mini_batch_size`` rows (or ``mini_batch_num_tokens`` tokens): a
  mini-batch may hold the end of the anchors and the start of the positives. With three columns of
  256 rows and mini-batches of 512 that is two forward passes instead of three. Otherwise every
  column is cut on its own, as upstream does.
* **Own width.** Each mini-batch is padded only to its own longest row.
* **One pass when it fits.** :attr:`MiniBatchPlan.single_pass` says that one mini-batch holds every
  row of the batch: GradCache then buys nothing, and the caller runs the plain forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from st_ext.losses.features import BOUNDARY_KEYS, MAX_LENGTH_KEYS, Features, Ranges, batch_size_of, is_flattened


@dataclass(frozen=True)
class ColumnLayout:
    """Per-row facts of one column, on the host: enough to cut and pad it without asking the device again.

    ``lengths``: non-padding tokens per row (None when the features say nothing about padding);
    ``ends``: padded layout, one past each row's last real token (the width that row needs);
    ``right_padded``: every row starts at position 0, so padding can be added on the right;
    ``bounds``: flattened layout, the token offsets of the rows (``cu_seq_lens_q``).
    """

    rows: int
    lengths: np.ndarray | None = None
    ends: np.ndarray | None = None
    right_padded: bool = False
    bounds: np.ndarray | None = None

    @property
    def flattened(self) -> bool:
        return self.bounds is not None


def layout_of(features: Features) -> ColumnLayout:
    """The column's :class:`ColumnLayout`, from a single device-to-host copy."""
    rows = batch_size_of(features)
    if is_flattened(features):
        bounds = features["cu_seq_lens_q"].detach().cpu().to(torch.int64).numpy()
        return ColumnLayout(rows, lengths=np.diff(bounds), bounds=bounds)
    mask = features.get("attention_mask")
    if not isinstance(mask, Tensor) or mask.ndim != 2:
        return ColumnLayout(rows)
    active = mask.detach().bool()
    width = active.shape[1]
    positions = torch.arange(1, width + 1, device=active.device)
    facts = torch.stack(
        [
            active.sum(dim=1),
            (active * positions).amax(dim=1) if width else active.sum(dim=1),
            # The first real token's position; an empty row counts as starting at 0.
            torch.where(active.any(dim=1), active.to(torch.int8).argmax(dim=1), 0) if width else active.sum(dim=1),
        ]
    )
    lengths, ends, starts = facts.cpu().numpy()
    return ColumnLayout(rows, lengths=lengths, ends=ends, right_padded=not starts.any())


# ---------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True)
class Segment:
    """Rows ``begin:end`` of column ``column``, part of one mini-batch."""

    column: int
    begin: int
    end: int

    @property
    def rows(self) -> int:
        return self.end - self.begin


#: The segments one forward pass embeds, in order; its output rows follow them.
MiniBatch = tuple[Segment, ...]


@dataclass(frozen=True)
class MiniBatchPlan:
    """Every forward pass of one batch: ``minibatches`` in order, and the layouts they were cut with.

    ``single_pass``: the mini-batch limit holds every row of every column at once (one merged
    mini-batch, or one per column that could not be merged): the uncached forward and backward suffice.
    """

    minibatches: list[MiniBatch]
    layouts: list[ColumnLayout]
    single_pass: bool = False

    @property
    def merged(self) -> bool:
        return any(len(minibatch) > 1 for minibatch in self.minibatches)

    def column_ranges(self) -> list[Ranges]:
        """Each column's ``(begin, end)`` pieces, in order (the mini-batches a frozen encoder can reuse)."""
        ranges: list[Ranges] = [[] for _ in self.layouts]
        for minibatch in self.minibatches:
            for segment in minibatch:
                ranges[segment.column].append((segment.begin, segment.end))
        return ranges


def plan_minibatches(
    sentence_features: Sequence[Features],
    layouts: Sequence[ColumnLayout],
    mini_batch_size: int,
    mini_batch_num_tokens: int | None = None,
    *,
    merge: bool = True,
) -> MiniBatchPlan:
    """Cut the batch into mini-batches of at most ``mini_batch_size`` rows (or ``mini_batch_num_tokens``
    non-padding tokens; a row longer than that goes alone), across columns when they can be merged."""
    if mini_batch_num_tokens is not None and any(layout.lengths is None for layout in layouts):
        raise ValueError(
            "mini_batch_num_tokens needs per-row token counts, but the features hold neither 'cu_seq_lens_q' "
            "(flattened inputs) nor an 'attention_mask' (padded inputs). Use mini_batch_size instead."
        )
    all_rows = [(column, row) for column, layout in enumerate(layouts) for row in range(layout.rows)]
    merged_groups = _cut(all_rows, layouts, mini_batch_size, mini_batch_num_tokens)
    single_pass = len(merged_groups) <= 1
    if merge and len(layouts) > 1 and can_merge(sentence_features, layouts):
        minibatches = [_segments(group) for group in merged_groups]
    else:
        minibatches = []
        for column, layout in enumerate(layouts):
            rows = [(column, row) for row in range(layout.rows)]
            minibatches += [_segments(group) for group in _cut(rows, layouts, mini_batch_size, mini_batch_num_tokens)]
    return MiniBatchPlan(minibatches, list(layouts), single_pass)


def _cut(
    rows: list[tuple[int, int]], layouts: Sequence[ColumnLayout], size: int, num_tokens: int | None
) -> list[list[tuple[int, int]]]:
    if num_tokens is None:
        return [rows[begin : begin + size] for begin in range(0, len(rows), size)]
    groups: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    used = 0
    for column, row in rows:
        length = int(layouts[column].lengths[row])
        if current and used + length > num_tokens:
            groups.append(current)
            current, used = [], 0
        current.append((column, row))
        used += length
    if current:
        groups.append(current)
    return groups


def _segments(rows: list[tuple[int, int]]) -> MiniBatch:
    """Consecutive rows of one column as one segment each."""
    segments: list[Segment] = []
    for column, row in rows:
        if segments and segments[-1].column == column and segments[-1].end == row:
            segments[-1] = Segment(column, segments[-1].begin, row + 1)
        else:
            segments.append(Segment(column, row, row + 1))
    return tuple(segments)


def can_merge(sentence_features: Sequence[Features], layouts: Sequence[ColumnLayout]) -> bool:
    """Whether the columns can share forward passes without changing any row's result: the same keys,
    equal metadata (prompt lengths, task names), every tensor indexed by row (or by token when
    flattened), and padding that can be extended on the right (or none)."""
    first = sentence_features[0]
    if any(set(features) != set(first) for features in sentence_features[1:]):
        return False
    flattened = [layout.flattened for layout in layouts]
    if any(flattened) and not all(flattened):
        return False
    if not all(flattened) and not all(layout.right_padded for layout in layouts):
        return False
    for key, value in first.items():
        values = [features[key] for features in sentence_features]
        if key in BOUNDARY_KEYS or key in MAX_LENGTH_KEYS:
            continue
        if isinstance(value, Tensor) and key != "prompt_length":
            for other, layout in zip(values, layouts):
                if not isinstance(other, Tensor) or other.ndim != value.ndim or other.ndim == 0:
                    return False
                if layout.flattened:
                    if other.shape[:-1] != value.shape[:-1] or other.shape[-1] != layout.bounds[-1]:
                        return False
                elif other.shape[0] != layout.rows or other.shape[2:] != value.shape[2:]:
                    return False
                elif other.ndim >= 2 and other.shape[1] != value.shape[1] and other.is_floating_point():
                    return False
        elif not all(_equal(value, other) for other in values[1:]):
            return False
    return True


def _equal(first: Any, other: Any) -> bool:
    try:
        if isinstance(first, Tensor) or isinstance(other, Tensor):
            return isinstance(first, Tensor) and isinstance(other, Tensor) and torch.equal(first, other.to(first.device))
        return bool(first == other)
    except (RuntimeError, ValueError, TypeError):
        return False


# ---------------------------------------------------------------------------------------------
# Building one mini-batch's features


def minibatch_features(sentence_features: Sequence[Features], plan: MiniBatchPlan, minibatch: MiniBatch) -> Features:
    """The features one forward pass embeds: every segment's rows, as copies, in order, padded only as
    far as the mini-batch's own longest row needs."""
    pieces = [
        slice_rows(sentence_features[segment.column], segment.begin, segment.end, plan.layouts[segment.column])
        for segment in minibatch
    ]
    if len(pieces) == 1:
        return pieces[0]
    if plan.layouts[minibatch[0].column].flattened:
        return _concat_flattened(pieces)
    return _concat_padded(pieces)


def slice_rows(features: Features, begin: int, end: int, layout: ColumnLayout) -> Features:
    """Rows ``begin:end`` of a column as a copy, cut with its host-side layout (no device synchronisation):
    padded rows lose the trailing padding none of them needs; flattened rows get their boundaries,
    row numbers and longest length rebuilt."""
    if layout.flattened:
        return _slice_flattened(features, begin, end, layout)
    seq_len = width = None
    mask = features.get("attention_mask")
    if layout.ends is not None and isinstance(mask, Tensor):
        seq_len = mask.shape[1]
        width = int(layout.ends[begin:end].max()) if end > begin else 0
    sliced = {}
    for key, value in features.items():
        if isinstance(value, Tensor) and value.ndim >= 1:
            value = value[begin:end]
            if width is not None and value.ndim >= 2 and value.shape[1] == seq_len:
                value = value[:, :width]
            value = value.clone()
        sliced[key] = value
    return sliced


def _slice_flattened(features: Features, begin: int, end: int, layout: ColumnLayout) -> Features:
    bounds = layout.bounds
    first, last, total = int(bounds[begin]), int(bounds[end]), int(bounds[-1])
    new_bounds = torch.from_numpy(bounds[begin : end + 1] - first)
    sliced: Features = {}
    for key, value in features.items():
        if key in BOUNDARY_KEYS:
            sliced[key] = new_bounds.to(device=value.device, dtype=value.dtype)
        elif key in MAX_LENGTH_KEYS:
            sliced[key] = int(layout.lengths[begin:end].max()) if end > begin else 0
        elif key == "seq_idx":
            sliced[key] = value[..., first:last] - begin
        elif isinstance(value, Tensor) and value.ndim >= 1 and value.shape[-1] == total:
            sliced[key] = value[..., first:last].clone()
        else:
            sliced[key] = value.clone() if isinstance(value, Tensor) else value
    return sliced


def _concat_padded(pieces: list[Features]) -> Features:
    """Row-wise concatenation; a narrower piece's token-axis tensors are zero-padded on the right, where
    its attention mask is 0."""
    width = max(piece["attention_mask"].shape[1] for piece in pieces)

    def padded(piece: Features, value: Tensor) -> Tensor:
        own_width = piece["attention_mask"].shape[1]
        if value.ndim < 2 or value.shape[1] != own_width or own_width == width:
            return value
        return F.pad(value, [0, 0] * (value.ndim - 2) + [0, width - own_width])

    merged: Features = {}
    for key, value in pieces[0].items():
        if not isinstance(value, Tensor) or key == "prompt_length" or value.ndim == 0:
            merged[key] = value
        else:
            merged[key] = torch.cat([padded(piece, piece[key]) for piece in pieces], dim=0)
    return merged


def _concat_flattened(pieces: list[Features]) -> Features:
    """Token-wise concatenation: boundaries shifted by the tokens before, row numbers by the rows before."""
    tokens = [piece["input_ids"].shape[-1] for piece in pieces]
    token_offsets = np.cumsum([0, *tokens])
    row_offsets = np.cumsum([0, *(piece["cu_seq_lens_q"].shape[0] - 1 for piece in pieces)])
    merged: Features = {}
    for key, value in pieces[0].items():
        values = [piece[key] for piece in pieces]
        if key in BOUNDARY_KEYS:
            merged[key] = torch.cat([values[0], *(other[1:] + int(token_offsets[i]) for i, other in enumerate(values) if i)])
        elif key in MAX_LENGTH_KEYS:
            merged[key] = max(values)
        elif key == "seq_idx":
            merged[key] = torch.cat([other + int(row_offsets[i]) for i, other in enumerate(values)], dim=-1)
        elif isinstance(value, Tensor) and value.ndim >= 1 and value.shape[-1] == tokens[0]:
            merged[key] = torch.cat(values, dim=-1)
        else:
            merged[key] = value
    return merged


def split_rows(output: Tensor, minibatch: MiniBatch) -> list[Tensor]:
    """One mini-batch's output rows, one tensor (a view) per segment."""
    return list(output.split([segment.rows for segment in minibatch]))
