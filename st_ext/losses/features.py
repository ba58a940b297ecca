"""One input column's tokenized features, padded or flattened: its rows, their token ids, mini-batch slices.

sentence-transformers hands a loss one dict of features per input column, in one of two layouts:

* padded: ``input_ids`` and ``attention_mask`` of shape ``(rows, width)``;
* flattened (sentence-transformers 5.4+, when the model's attention takes variable-length
  sequences, e.g. flash-attention 2): every row concatenated into ``input_ids`` of shape
  ``(1, tokens)``, row boundaries in ``cu_seq_lens_q``/``cu_seq_lens_k`` (``rows + 1`` offsets),
  per-token ``position_ids`` and ``seq_idx``, the longest row in ``max_length_q``/``max_length_k``,
  and no attention mask.

Everything in st_ext that splits a column into mini-batches, picks rows out of it, or keys a row
by its token ids goes through these functions, so both layouts give the same rows, the same keys
and the same losses. Every slice is a copy: a module that edits its input in place (sentence-
transformers 4.x's ``Pooling`` zeroes prompt positions in the mask it is given) cannot change what
a later pass over the same rows sees.
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

Features = dict[str, Any]
Ranges = list[tuple[int, int]]

#: Keys holding the row boundaries of flattened features, rebuilt for every slice.
BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k")
#: Keys holding the longest row of flattened features, recomputed for every slice.
MAX_LENGTH_KEYS = ("max_length_q", "max_length_k")
#: Keys only flattened features carry; a padded copy drops them.
FLATTENED_ONLY_KEYS = (*BOUNDARY_KEYS, *MAX_LENGTH_KEYS, "seq_idx", "position_ids")


def is_flattened(features: Features) -> bool:
    """Whether the column's rows are concatenated into one sequence (no padding)."""
    return "cu_seq_lens_q" in features


def row_boundaries(features: Features) -> list[int]:
    """Token offsets of every row of flattened features: row ``i`` is tokens ``b[i]:b[i + 1]``."""
    return features["cu_seq_lens_q"].tolist()


def batch_size_of(features: Features) -> int:
    """Rows in a column's features, in either layout."""
    if is_flattened(features):
        return len(features["cu_seq_lens_q"]) - 1
    for key in ("input_ids", "attention_mask"):
        if isinstance(features.get(key), Tensor):
            return features[key].shape[0]
    return next(value.shape[0] for value in features.values() if isinstance(value, Tensor) and value.ndim > 0)


def row_token_ids(features: Features) -> list[np.ndarray]:
    """Every row's token ids without padding, as int64 arrays (numpy: row-by-row indexing is ten times
    faster there than in torch, and this runs every step)."""
    input_ids = features["input_ids"].detach().cpu().to(torch.int64).numpy()
    if is_flattened(features):
        bounds = row_boundaries(features)
        tokens = input_ids.reshape(-1)
        return [tokens[begin:end] for begin, end in zip(bounds[:-1], bounds[1:])]
    mask = features.get("attention_mask")
    if mask is None:
        return list(input_ids)
    return [ids[keep] for ids, keep in zip(input_ids, mask.detach().cpu().bool().numpy())]


def row_token_keys(features: Features) -> list[bytes]:
    """One key per row: its non-padding token ids, so the same text has the same key in either layout
    and at any padding."""
    return [ids.tobytes() for ids in row_token_ids(features)]


def row_lengths(features: Features) -> list[int]:
    """Non-padding tokens in every row."""
    if is_flattened(features):
        bounds = row_boundaries(features)
        return [end - begin for begin, end in zip(bounds[:-1], bounds[1:])]
    mask = features.get("attention_mask")
    if not isinstance(mask, Tensor):
        raise ValueError(
            "mini_batch_num_tokens needs per-row token counts, but the features hold neither 'cu_seq_lens_q' "
            "(flattened inputs) nor an 'attention_mask' (padded inputs). Use mini_batch_size instead."
        )
    return mask.sum(dim=1).tolist()


def minibatch_ranges(features: Features, mini_batch_size: int, mini_batch_num_tokens: int | None = None) -> Ranges:
    """``(begin, end)`` rows of each mini-batch: ``mini_batch_size`` rows each, or, with a token budget,
    as many rows as fit ``mini_batch_num_tokens`` non-padding tokens (a longer row goes alone)."""
    rows = batch_size_of(features)
    if mini_batch_num_tokens is None:
        return [(begin, min(begin + mini_batch_size, rows)) for begin in range(0, rows, mini_batch_size)]
    cumulative = np.cumsum(row_lengths(features)).tolist()
    ranges, begin = [], 0
    while begin < rows:
        used_before = cumulative[begin - 1] if begin else 0
        end = max(bisect.bisect_right(cumulative, used_before + mini_batch_num_tokens), begin + 1)
        ranges.append((begin, end))
        begin = end
    return ranges


def slice_minibatch(features: Features, begin: int, end: int) -> Features:
    """Rows ``begin:end`` of a column, as a copy, without padding none of them needs.

    Padded: trailing padding columns that every row of the slice shares are dropped, so a
    mini-batch of short texts is not embedded at the width of the batch's longest text (leading
    padding is kept, so positions do not shift). Flattened: the rows' tokens, with boundaries,
    ``seq_idx`` and maximum lengths rebuilt for the slice. Non-tensor values pass through.
    """
    if is_flattened(features):
        return _select_flattened(features, list(range(begin, end)))
    return _trim_padding({key: _rows(value, slice(begin, end)) for key, value in features.items()}, features)


def select_rows(features: Features, rows: list[int]) -> Features:
    """The given rows of a column, in that order, as a copy trimmed of padding they all share."""
    if is_flattened(features):
        return _select_flattened(features, rows)
    index = torch.tensor(rows, dtype=torch.long)
    picked = {
        key: _rows(value, index.to(value.device) if isinstance(value, Tensor) else index)
        for key, value in features.items()
    }
    return _trim_padding(picked, features)


def _rows(value: Any, index: slice | Tensor) -> Any:
    if isinstance(value, Tensor) and value.ndim >= 1:
        return value[index]
    return value


def _trim_padding(picked: Features, original: Features) -> Features:
    """``picked`` rows with the trailing padding columns they all share dropped, every tensor copied."""
    mask = picked.get("attention_mask")
    width = seq_len = None
    if isinstance(mask, Tensor) and mask.ndim == 2:
        seq_len = original["attention_mask"].shape[1]
        active = mask.bool().any(dim=0).nonzero()
        width = int(active.max()) + 1 if len(active) else seq_len
    trimmed = {}
    for key, value in picked.items():
        if isinstance(value, Tensor):
            if width is not None and value.ndim >= 2 and value.shape[1] == seq_len:
                value = value[:, :width]
            value = value.clone()
        trimmed[key] = value
    return trimmed


def _select_flattened(features: Features, rows: list[int]) -> Features:
    """The given rows of flattened features, concatenated in order, with their metadata rebuilt."""
    bounds = row_boundaries(features)
    total = bounds[-1]
    lengths = [bounds[row + 1] - bounds[row] for row in rows]
    tokens = _token_selector(bounds, rows)
    new_bounds = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=features["cu_seq_lens_q"].dtype)
    selected: Features = {}
    for key, value in features.items():
        if key in BOUNDARY_KEYS:
            selected[key] = new_bounds.to(value.device)
        elif key in MAX_LENGTH_KEYS:
            selected[key] = max(lengths, default=0)
        elif key == "seq_idx":
            selected[key] = _renumbered_rows(value, tokens, rows, lengths)
        elif isinstance(value, Tensor) and value.ndim >= 1 and value.shape[-1] == total:
            index = tokens if isinstance(tokens, slice) else tokens.to(value.device)
            selected[key] = value[..., index].clone()
        else:
            selected[key] = value.clone() if isinstance(value, Tensor) else value
    return selected


def _token_selector(bounds: list[int], rows: list[int]) -> slice | Tensor:
    """The token positions of ``rows``: a slice when they are consecutive (every mini-batch, so no
    per-token index is built on the host), else an index tensor."""
    if not rows:
        return slice(0, 0)
    if rows == list(range(rows[0], rows[-1] + 1)):
        return slice(bounds[rows[0]], bounds[rows[-1] + 1])
    return torch.cat([torch.arange(bounds[row], bounds[row + 1]) for row in rows])


def _renumbered_rows(seq_idx: Tensor, tokens: slice | Tensor, rows: list[int], lengths: list[int]) -> Tensor:
    """Each selected token's row number within the selection."""
    if isinstance(tokens, slice):
        return seq_idx[..., tokens] - (rows[0] if rows else 0)
    numbers = torch.repeat_interleave(torch.arange(len(rows), dtype=seq_idx.dtype), torch.tensor(lengths))
    return numbers.reshape(*seq_idx.shape[:-1], -1).to(seq_idx.device)


def to_padded(features: Features, pad_token_id: int = 0) -> Features:
    """Flattened features as a right-padded batch (``input_ids``, ``attention_mask``), for an encoder that
    cannot read flattened inputs; other keys pass through, the flattening metadata is dropped."""
    if not is_flattened(features):
        return features
    rows = [torch.from_numpy(ids) for ids in row_token_ids(features)]
    device = features["input_ids"].device
    input_ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad_token_id)
    lengths = torch.tensor([len(ids) for ids in rows])
    attention_mask = (torch.arange(input_ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.int64)
    padded = {
        key: value
        for key, value in features.items()
        if key not in FLATTENED_ONLY_KEYS and not (isinstance(value, Tensor) and key == "input_ids")
    }
    padded["input_ids"] = input_ids.to(device=device, dtype=features["input_ids"].dtype)
    padded["attention_mask"] = attention_mask.to(device)
    return padded


def reads_flattened(encoder: nn.Module) -> bool:
    """Whether ``encoder``'s input module takes flattened features (its own preprocessing flattens)."""
    return any(getattr(module, "can_flatten_inputs", False) is True for module in encoder.modules())
