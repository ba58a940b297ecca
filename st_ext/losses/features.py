"""One input column's features: which part of every key belongs to which row, and cutting rows out of them.

The layouts (padded and flattened text, per-row images, flattened media with grids, per-image keys;
see docs/every-input.md) follow upstream's ``_create_minibatch`` (sentence-transformers 6.2), so a
slice holds what upstream's engine would embed for the same rows. :func:`layout_of` reads the few
counts it needs from the device once per column and batch; cutting afterwards never reads it again.
What is not a tensor with rows (strings, numbers, 0-d tensors) is shared by every row; a tensor no rule
covers raises :class:`UnsliceableFeatureError`: a guessed cut would embed the wrong
pixels without a sound. Every slice is a copy: a module that edits its input in place (4.x's
``Pooling`` zeroes prompt positions in the mask) cannot change what a later pass over the rows sees.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

Features = dict[str, Any]
Ranges = list[tuple[int, int]]

#: Keys of flattened features rebuilt for every slice: row boundaries, longest row.
BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k")
MAX_LENGTH_KEYS = ("max_length_q", "max_length_k")
FLATTENED_ONLY_KEYS = (*BOUNDARY_KEYS, *MAX_LENGTH_KEYS, "seq_idx", "position_ids")
#: ``(grid, patches, per-row count)`` keys of flattened media, and the axes they are cut along.
MEDIA_GRIDS = (
    ("image_grid_thw", "pixel_values", "num_images_per_sample", "image", "image_patch"),
    ("video_grid_thw", "pixel_values_videos", "num_videos_per_sample", "video", "video_patch"),
)
#: Keys indexed per image by models without a grid (LLaVA, Gemma3).
PER_IMAGE_KEYS = ("pixel_values", "image_position_ids", "image_sizes")
#: Keys of processors that pad images per row (Idefics3, Mllama): their image keys are row-first.
SAMPLE_FIRST_IMAGE_KEYS = ("pixel_attention_mask", "aspect_ratio_ids")
_MEDIA_KEYS = frozenset(
    {key for entry in MEDIA_GRIDS for key in entry[:3]} | {*PER_IMAGE_KEYS, *SAMPLE_FIRST_IMAGE_KEYS}
)
#: Positions scored although their attention mask is 0 (ColBERT query expansion): never trimmed away.
SCORED_PADDING_KEY = "query_expansion_positions"

# How a key is cut (values of ColumnLayout.cuts): along a named axis whose per-row offsets the
# layout holds, or one of these.
ROW, TOKEN, SHARED, BOUNDARIES, MAX_LENGTH, SEQ_IDX = "row", "token", "shared", "boundaries", "max_length", "seq_idx"


class UnsliceableFeatureError(ValueError):
    """A feature no rule says how to split into rows: the step stops rather than embed a guessed slice."""


def is_flattened(features: Features) -> bool:
    return "cu_seq_lens_q" in features


def collator_inputs(features: Features) -> dict[str, Tensor]:
    """The integer tensors of ``features`` (the data collator's token ids, masks and lengths): what a module
    may edit in place, as opposed to float tensors (outputs an earlier call left there, media)."""
    return {
        key: value
        for key, value in features.items()
        if isinstance(value, Tensor) and not value.is_floating_point() and not value.is_complex()
    }


def batch_size_of(features: Features) -> int:
    """Rows in a column's features, in either layout (the text keys first: media may count images)."""
    if is_flattened(features):
        return len(features["cu_seq_lens_q"]) - 1
    for key in ("input_ids", "attention_mask"):
        if isinstance(features.get(key), Tensor):
            return features[key].shape[0]
    return next(value.shape[0] for value in features.values() if isinstance(value, Tensor) and value.ndim > 0)


@dataclass(frozen=True)
class ColumnLayout:
    """How to cut one column into rows, on the host.

    ``cuts``: for every key, the axis it is cut along (a key of ``offsets``) or how it is rebuilt;
    ``offsets``: per axis, ``rows + 1`` offsets: row ``i`` owns entries ``offsets[i]:offsets[i + 1]``;
    ``token_axis_keys``: padded keys whose second axis is the token axis (trimmed to a slice's width);
    ``lengths``: non-padding tokens per row (None when the features say nothing about padding);
    ``ends``: padded layout, one past each row's last scored token (the width that row needs);
    ``right_padded``: every row starts at position 0, so padding can be added on the right;
    ``flattened``: the rows are one sequence of tokens, and ``offsets[TOKEN]`` where each starts;
    ``has_media_axes``: some key is cut along an axis of its own (images, videos). Plain data, so that
    planning mini-batches reads the layout without calling back into this module.
    """

    rows: int
    cuts: Mapping[str, str]
    offsets: Mapping[str, np.ndarray]
    token_axis_keys: frozenset[str] = frozenset()
    lengths: np.ndarray | None = None
    ends: np.ndarray | None = None
    right_padded: bool = False
    flattened: bool = False
    has_media_axes: bool = False


def layout_of(features: Features) -> ColumnLayout:
    """The column's :class:`ColumnLayout`, from one device-to-host copy of its text facts (and one of
    its media counts, if it has media)."""
    rows = batch_size_of(features)
    offsets: dict[str, np.ndarray] = {ROW: np.arange(rows + 1)}
    if is_flattened(features):
        bounds = features["cu_seq_lens_q"].detach().cpu().to(torch.int64).numpy()
        offsets[TOKEN] = bounds
        text: dict[str, Any] = {"lengths": np.diff(bounds)}
        rebuilt = {**dict.fromkeys(BOUNDARY_KEYS, BOUNDARIES), **dict.fromkeys(MAX_LENGTH_KEYS, MAX_LENGTH)}
        rebuilt["seq_idx"] = SEQ_IDX
        width = None
    else:
        text = _padded_text_facts(features)
        rebuilt = _media_cuts(features, rows, offsets)
        width = features["attention_mask"].shape[1] if "lengths" in text else None
    cuts: dict[str, str] = {}
    token_axis_keys = set()
    for key, value in features.items():
        if key in rebuilt:
            cuts[key] = rebuilt[key]
        elif not isinstance(value, Tensor) or value.ndim == 0:
            cuts[key] = SHARED
        elif TOKEN in offsets and value.shape[-1] == offsets[TOKEN][-1]:
            cuts[key] = TOKEN
        elif value.shape[0] == rows:
            cuts[key] = ROW
            if width is not None and value.ndim >= 2 and value.shape[1] == width and not is_media_key(key):
                token_axis_keys.add(key)
        else:
            raise UnsliceableFeatureError(
                f"Cannot split the features into mini-batches: key {key!r} "
                f"holds a tensor of shape {tuple(value.shape)} whose first axis is not the column's {rows} rows, "
                "and st_ext knows no rule that says which part of it belongs to which row (it knows padded and "
                "flattened text, per-row images, Qwen2-VL-style image/video grids with num_images_per_sample, "
                "and per-image keys). Rather than guess, the step stops. Use the uncached loss for this model, "
                "or report the key and the model so a rule can be added."
            )
    return ColumnLayout(
        rows,
        cuts,
        offsets,
        frozenset(token_axis_keys),
        **text,
        flattened=TOKEN in offsets,
        has_media_axes=any(cut not in (ROW, TOKEN, SHARED, BOUNDARIES, MAX_LENGTH, SEQ_IDX) for cut in cuts.values()),
    )


def is_media_key(key: str) -> bool:
    """Keys of images and videos: never a token axis, whatever their shape."""
    return key.startswith("pixel_") or key in _MEDIA_KEYS


def _padded_text_facts(features: Features) -> dict[str, Any]:
    """Lengths, ends and padding side of padded rows; positions a model scores although they are masked
    (query expansion) count as part of their row."""
    mask = features.get("attention_mask")
    if not isinstance(mask, Tensor) or mask.ndim != 2:
        return {}
    active = mask.detach().bool()
    scored = features.get(SCORED_PADDING_KEY)
    if isinstance(scored, Tensor) and scored.shape == active.shape:
        active = active | scored.detach().bool().to(active.device)
    width = active.shape[1]
    positions = torch.arange(1, width + 1, device=active.device)
    facts = torch.stack(
        [
            mask.detach().bool().sum(dim=1),
            (active * positions).amax(dim=1) if width else active.sum(dim=1),
            # The first scored position; an empty row counts as starting at 0.
            torch.where(active.any(dim=1), active.to(torch.int8).argmax(dim=1), 0) if width else active.sum(dim=1),
        ]
    )
    lengths, ends, starts = facts.cpu().numpy()
    return {"lengths": lengths, "ends": ends, "right_padded": not starts.any()}


def _media_cuts(features: Features, rows: int, offsets: dict[str, np.ndarray]) -> dict[str, str]:
    """Cuts of the media keys of padded features; adds the per-row offsets of their axes to ``offsets``."""
    cuts: dict[str, str] = {}
    counts = {key: features[key] for _, _, key, _, _ in MEDIA_GRIDS if isinstance(features.get(key), Tensor)}
    grids = [
        entry
        for entry in MEDIA_GRIDS
        if isinstance(features.get(entry[0]), Tensor) and isinstance(features.get(entry[1]), Tensor)
    ]
    per_image = (
        not any(entry[1] == "pixel_values" for entry in grids)
        and "num_images_per_sample" in counts
        and isinstance(features.get("pixel_values"), Tensor)
        and not any(key in features for key in SAMPLE_FIRST_IMAGE_KEYS)
    )
    if not grids and not per_image:
        return cuts
    # The counts that decide the axes, read from the device in one copy.
    host = _to_host({**counts, **{grid: features[grid].prod(dim=1) for grid, *_ in grids}})
    for grid, patches, count, item_axis, patch_axis in grids:
        if count in host:
            items = _offsets(host[count])
            cuts[grid] = item_axis
        elif features[grid].shape[0] == rows:
            items = np.arange(rows + 1)
        else:
            continue  # the layout check below names the keys it cannot cut
        patch_ends = _offsets(host[grid])
        offsets[item_axis], offsets[patch_axis] = items, patch_ends[items]
        cuts[patches] = patch_axis
    if per_image:
        images = _offsets(host["num_images_per_sample"])
        if features["pixel_values"].shape[0] == images[-1]:
            offsets["image"] = images
            cuts.update({key: "image" for key in PER_IMAGE_KEYS if key in features})
    return cuts


def _to_host(tensors: dict[str, Tensor]) -> dict[str, np.ndarray]:
    """1-D integer tensors, copied to the host in one copy."""
    if not tensors:
        return {}
    sizes = [len(value) for value in tensors.values()]
    flat = torch.cat([value.detach().reshape(-1).to(torch.int64).cpu() for value in tensors.values()]).numpy()
    return dict(zip(tensors, np.split(flat, np.cumsum(sizes)[:-1])))


def _offsets(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def slice_rows(features: Features, begin: int, end: int, layout: ColumnLayout) -> Features:
    """Rows ``begin:end`` of a column as a copy: padded rows lose the trailing padding none of them needs,
    flattened rows get their boundaries, row numbers and longest length rebuilt, media keys keep the
    rows' images (and are left out when there are none)."""
    width = None
    if layout.ends is not None and end > begin:
        width = int(layout.ends[begin:end].max()) or None
    sliced: Features = {}
    for key, value in features.items():
        cut = layout.cuts[key]
        if cut == SHARED:
            sliced[key] = value.clone() if isinstance(value, Tensor) else value
        elif cut == BOUNDARIES:
            new_bounds = torch.from_numpy(layout.offsets[TOKEN][begin : end + 1] - layout.offsets[TOKEN][begin])
            sliced[key] = new_bounds.to(device=value.device, dtype=value.dtype)
        elif cut == MAX_LENGTH:
            sliced[key] = int(np.diff(layout.offsets[TOKEN][begin : end + 1]).max()) if end > begin else 0
        elif cut == SEQ_IDX:
            sliced[key] = value[..., layout.offsets[TOKEN][begin] : layout.offsets[TOKEN][end]] - begin
        elif cut == TOKEN:
            sliced[key] = value[..., layout.offsets[TOKEN][begin] : layout.offsets[TOKEN][end]].clone()
        else:
            low, high = int(layout.offsets[cut][begin]), int(layout.offsets[cut][end])
            if high == low and cut != ROW:
                continue
            value = value[low:high]
            if width is not None and key in layout.token_axis_keys:
                value = value[:, :width]
            sliced[key] = value.clone()
    return sliced


def select_rows(features: Features, rows: Sequence[int], layout: ColumnLayout | None = None) -> Features:
    """The given rows of a column, in that order, as one copy (runs of consecutive rows cut at once)."""
    layout = layout or layout_of(features)
    runs: Ranges = []
    for row in rows:
        if runs and runs[-1][1] == row:
            runs[-1] = (runs[-1][0], row + 1)
        else:
            runs.append((row, row + 1))
    if not runs:
        return slice_rows(features, 0, 0, layout)
    return concat_slices([slice_rows(features, begin, end, layout) for begin, end in runs], layout)


def concat_slices(pieces: Sequence[Features], layout: ColumnLayout) -> Features:
    """Slices (of this column, or of columns that :func:`~st_ext.losses.minibatches.can_merge`), as one
    batch of their rows in order: padded token axes zero-padded on the right, flattened boundaries and
    row numbers shifted by the tokens and rows before."""
    if len(pieces) == 1:
        return pieces[0]
    if layout.flattened:
        tokens = [piece["input_ids"].shape[-1] for piece in pieces]
        token_offsets = np.cumsum([0, *tokens])
        row_offsets = np.cumsum([0, *(len(piece["cu_seq_lens_q"]) - 1 for piece in pieces)])
    width = max((piece["attention_mask"].shape[1] for piece in pieces if "attention_mask" in piece), default=None)
    merged: Features = {}
    for key, cut in layout.cuts.items():
        values = [piece[key] for piece in pieces if key in piece]
        if not values:
            continue
        if cut == SHARED:
            merged[key] = values[0]
        elif cut == BOUNDARIES:
            merged[key] = torch.cat([values[0], *(v[1:] + int(token_offsets[i]) for i, v in enumerate(values) if i)])
        elif cut == MAX_LENGTH:
            merged[key] = max(values)
        elif cut == SEQ_IDX:
            merged[key] = torch.cat([v + int(row_offsets[i]) for i, v in enumerate(values)], dim=-1)
        elif cut == TOKEN:
            merged[key] = torch.cat(values, dim=-1)
        elif key in layout.token_axis_keys:
            merged[key] = torch.cat([_pad_tokens(value, width) for value in values], dim=0)
        else:
            merged[key] = torch.cat(values, dim=0)
    return merged


def minibatch_features(
    sentence_features: Sequence[Features], layouts: Sequence[ColumnLayout], minibatch: Sequence[Any]
) -> Features:
    """The features one forward pass embeds: the rows of every segment of ``minibatch``
    (:class:`~st_ext.losses.minibatches.Segment`), in order, padded only as far as its longest row needs."""
    pieces = [
        slice_rows(sentence_features[segment.column], segment.begin, segment.end, layouts[segment.column])
        for segment in minibatch
    ]
    return concat_slices(pieces, layouts[minibatch[0].column])


def _pad_tokens(value: Tensor, width: int | None) -> Tensor:
    if width is None or value.shape[1] == width:
        return value
    return F.pad(value, [0, 0] * (value.ndim - 2) + [0, width - value.shape[1]])


def row_token_ids(features: Features) -> list[np.ndarray]:
    """Every row's token ids without padding, as int64 arrays (numpy: row-by-row indexing is ten times
    faster there than in torch, and this runs every step)."""
    input_ids = features["input_ids"].detach().cpu().to(torch.int64).numpy()
    if is_flattened(features):
        bounds = features["cu_seq_lens_q"].tolist()
        tokens = input_ids.reshape(-1)
        return [tokens[begin:end] for begin, end in zip(bounds[:-1], bounds[1:])]
    mask = features.get("attention_mask")
    if mask is None:
        return list(input_ids)
    return [ids[keep] for ids, keep in zip(input_ids, mask.detach().cpu().bool().numpy())]


def row_keys(features: Features) -> list[bytes]:
    """One key per row: its non-padding token ids (the same in either layout and at any padding), and a
    digest of the row's own images and videos (two images of one size give the same placeholder tokens)."""
    if "input_ids" in features:
        keys = [ids.tobytes() for ids in row_token_ids(features)]
    else:
        keys = [b""] * batch_size_of(features)
    media = [key for key in features if is_media_key(key) and isinstance(features[key], Tensor)]
    if not media:
        return keys
    layout = layout_of(features)
    for key in media:
        if layout.cuts[key] == SHARED:
            continue
        offsets = layout.offsets[layout.cuts[key]]
        values = features[key].detach().cpu().contiguous()
        raw = values.reshape(values.shape[0], -1).view(torch.uint8).numpy() if values.numel() else None
        for row in range(layout.rows):
            begin, end = offsets[row], offsets[row + 1]
            digest = hashlib.blake2b(raw[begin:end].tobytes() if raw is not None else b"", digest_size=16)
            keys[row] += key.encode() + digest.digest()
    return keys


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
    padded = {key: value for key, value in features.items() if key not in (*FLATTENED_ONLY_KEYS, "input_ids")}
    padded["input_ids"] = input_ids.to(device=device, dtype=features["input_ids"].dtype)
    padded["attention_mask"] = attention_mask.to(device)
    return padded


def reads_flattened(encoder: nn.Module) -> bool:
    """Whether ``encoder``'s input module takes flattened features (its own preprocessing flattens)."""
    return any(getattr(module, "can_flatten_inputs", False) is True for module in encoder.modules())
