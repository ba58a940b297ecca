"""One batch's mini-batches, planned once on the host: which rows of which columns each forward pass embeds.

What decides GradCache's speed on an accelerator is how many forward passes it launches, how much
padding each carries, and whether the host waits for the device between them. So the plan is made
before any forward pass from each column's :class:`~st_ext.losses.features.ColumnLayout`. When the
columns can share a forward pass, the batch is one sequence of rows, column after column, cut into
mini-batches (one may hold the end of the anchors and the start of the positives: three columns of
256 rows at mini-batches of 512 take two passes, not three); otherwise every column is cut on its
own, as upstream does.

A shared pass is padded to its longest row, so rows of several columns share one only where that
costs no padding: flattened rows (no padding at all), or padded segments that are each as wide as the
pass. Short queries beside long passages (the usual case) are embedded column by column, so that one
pass over the whole batch holds no more than the uncached loss's forward passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from st_ext.losses.features import BOUNDARY_KEYS, MAX_LENGTH_KEYS, TOKEN, ColumnLayout, Features, Ranges


@dataclass(frozen=True)
class Segment:
    """Rows ``begin:end`` of column ``column``, part of one mini-batch."""

    column: int
    begin: int
    end: int


#: The segments one forward pass embeds, in order; its output rows follow them.
MiniBatch = tuple[Segment, ...]


@dataclass(frozen=True)
class MiniBatchPlan:
    """Every forward pass of one batch, in order, and the layouts they were cut with.

    ``single_pass``: the mini-batch limit holds every row of every column at once (one merged
    mini-batch, or one per column that could not be merged): the uncached forward and backward suffice.
    """

    minibatches: list[MiniBatch]
    layouts: list[ColumnLayout]
    single_pass: bool = False

    @property
    def merged(self) -> bool:
        return any(len(minibatch) > 1 for minibatch in self.minibatches)

    def split(self, count: int) -> tuple[MiniBatchPlan, MiniBatchPlan]:
        """The first ``count`` forward passes and the others, as two plans over the same layouts."""
        first = replace(self, minibatches=self.minibatches[:count], single_pass=False)
        return first, replace(self, minibatches=self.minibatches[count:], single_pass=False)

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
    if len(layouts) > 1 and can_merge(sentence_features, layouts):
        widths = [_row_widths(features, layout) for features, layout in zip(sentence_features, layouts)]
        minibatches = [part for group in merged_groups for part in _unpadded(_segments(group), widths)]
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
        lengths = layouts[column].lengths
        assert lengths is not None, "plan_minibatches refuses a token budget without per-row token counts"
        length = int(lengths[row])
        if current and used + length > num_tokens:
            groups.append(current)
            current, used = [], 0
        current.append((column, row))
        used += length
    if current:
        groups.append(current)
    return groups


def _row_widths(features: Features, layout: ColumnLayout) -> np.ndarray | None:
    """The width each row of a padded column needs (None: flattened rows, which carry no padding); rows
    whose features say nothing about padding need the column's whole width."""
    if layout.flattened:
        return None
    if layout.ends is not None:
        return layout.ends
    input_ids = features.get("input_ids")
    width = input_ids.shape[1] if isinstance(input_ids, Tensor) and input_ids.ndim >= 2 else 0
    return np.full(layout.rows, width)


def _unpadded(minibatch: MiniBatch, widths: Sequence[np.ndarray | None]) -> list[MiniBatch]:
    """``minibatch`` as one pass where its segments are all as wide as the pass (no row is padded further than
    in a pass of its own column), else as one pass per segment."""
    if len(minibatch) == 1:
        return [minibatch]
    own = []
    for segment in minibatch:
        column_widths = widths[segment.column]
        if column_widths is None:
            return [minibatch]
        own.append(int(column_widths[segment.begin : segment.end].max()))
    if len(set(own)) == 1:
        return [minibatch]
    return [(segment,) for segment in minibatch]


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
    flattened), and padding that can be extended on the right (or none). Media cut per image or patch
    is embedded column by column, as upstream does: how a model batches images is its own."""
    first = sentence_features[0]
    if any(set(features) != set(first) for features in sentence_features[1:]):
        return False
    if any(layout.has_media_axes for layout in layouts):
        return False
    flattened = [layout.flattened for layout in layouts]
    if any(flattened) and not all(flattened):
        return False
    if not all(flattened) and not all(layout.right_padded for layout in layouts):
        return False
    for key, value in first.items():
        if key in BOUNDARY_KEYS or key in MAX_LENGTH_KEYS:
            continue
        values = [features[key] for features in sentence_features]
        if isinstance(value, Tensor) and key != "prompt_length":
            for other, layout in zip(values, layouts):
                if not isinstance(other, Tensor) or other.ndim != value.ndim or other.ndim == 0:
                    return False
                if layout.flattened:
                    if other.shape[:-1] != value.shape[:-1] or other.shape[-1] != layout.offsets[TOKEN][-1]:
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
            return (
                isinstance(first, Tensor) and isinstance(other, Tensor) and torch.equal(first, other.to(first.device))
            )
        return bool(first == other)
    except (RuntimeError, ValueError, TypeError):
        return False
