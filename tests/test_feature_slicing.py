"""Every input layout is cut into rows as upstream's engine cuts it, and as the collator would have built those rows.

Two oracles check each slice of many generated layouts (padded, left-padded, flattened text; CLIP-style
per-row images; Qwen2-VL-style image and video grids with several or no images per row, with and without
per-row counts; LLaVA-style per-image keys; Idefics-style sample-first keys; ColBERT query expansion;
metadata that every row shares):

* **the rows rebuilt**: the features the collator builds for those rows alone (every token and pixel is
  tagged with its row, so a row's pixels given to another row cannot compare equal);
* **upstream's slicer** (``_create_minibatch``) of the installed release, for the layouts it handles, up
  to its trailing padding (st_ext trims on every release, upstream from 6.0 on).

A tensor no rule covers stops the step with an error naming the key and the model's input module.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import random
from dataclasses import dataclass, field

import pytest
import torch
from loss_checks import NoDeviceReads, features_of, text_columns

from st_ext import losses
from st_ext.losses.features import (
    UnsliceableFeatureError,
    is_media_key,
    layout_of,
    minibatch_features,
    select_rows,
    slice_rows,
)
from st_ext.losses.minibatches import can_merge, plan_minibatches

pytestmark = [pytest.mark.conformance, pytest.mark.usefixtures("one_torch_thread")]

PATCH_DIM = 6
IMAGE = (3, 4, 5)  # channels, height, width of a CLIP-style image
EXPANSION_FLOOR = 9


@dataclass(frozen=True)
class Row:
    """One row as the collator saw it: its text length, and the grid of each of its images and videos."""

    tag: int
    length: int
    images: tuple[tuple[int, int, int], ...] = ()
    videos: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class Layout:
    """A way a processor lays a batch out; ``build`` makes the features of any rows in it."""

    name: str
    padding: str = "right"  # right, left or flattened
    media: str = "none"  # none, per_row, grid, grid_without_counts, video, per_image, sample_first
    expansion: bool = False
    extras: dict = field(default_factory=dict)


LAYOUTS = [
    Layout("padded", extras={"modality": "text", "prompt_length": 2}),
    Layout("left-padded", padding="left"),
    Layout("flattened", padding="flattened"),
    Layout("per-row images (CLIP)", media="per_row", extras={"modality": "image"}),
    Layout("image grids (Qwen2-VL)", padding="left", media="grid", extras={"modality": "message"}),
    Layout("image grids, right padding", media="grid"),
    Layout("one image per row, no counts", media="grid_without_counts"),
    Layout("image and video grids", padding="left", media="video"),
    Layout("per-image keys (LLaVA)", media="per_image"),
    Layout("sample-first images (Idefics3)", media="sample_first"),
    Layout("query expansion (ColBERT)", expansion=True, extras={"task": "query"}),
]


def tokens(row: Row) -> torch.Tensor:
    return 1000 * (row.tag + 1) + torch.arange(row.length)


def build(layout: Layout, rows: list[Row], width: int | None = None, images_width: int | None = None) -> dict:
    """The features of ``rows`` as the collator builds them (padded to ``width``, or to the longest row;
    sample-first images padded to ``images_width`` images, or to the most any row has)."""
    features: dict = {}
    if layout.padding == "flattened":
        lengths = torch.tensor([row.length for row in rows])
        bounds = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
        features["input_ids"] = torch.cat([tokens(row) for row in rows]).unsqueeze(0)
        features["position_ids"] = torch.cat([torch.arange(row.length) for row in rows]).unsqueeze(0)
        features["cu_seq_lens_q"] = features["cu_seq_lens_k"] = bounds
        features["max_length_q"] = features["max_length_k"] = int(lengths.max())
        features["seq_idx"] = torch.repeat_interleave(torch.arange(len(rows)), lengths).unsqueeze(0)
    else:
        longest = max(row.length for row in rows)
        width = width or (max(longest, EXPANSION_FLOOR) if layout.expansion else longest)
        input_ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for index, row in enumerate(rows):
            where = slice(width - row.length, width) if layout.padding == "left" else slice(0, row.length)
            input_ids[index, where] = tokens(row)
            mask[index, where] = 1
        features.update(input_ids=input_ids, attention_mask=mask, token_type_ids=torch.zeros_like(mask))
        if layout.expansion:
            expansion = (mask == 0) & (torch.arange(width) < EXPANSION_FLOOR)
            features["input_ids"] = input_ids.masked_fill(expansion, 7)
            features["query_expansion_positions"] = expansion
    features.update(_media(layout, rows, images_width))
    features.update(layout.extras)
    return features


def _media(layout: Layout, rows: list[Row], images_width: int | None) -> dict:
    if layout.media == "per_row":
        return {"pixel_values": torch.stack([torch.full(IMAGE, float(row.tag)) for row in rows])}
    if layout.media in ("grid", "grid_without_counts", "video"):
        media = _grid_media(rows, "images", "image_grid_thw", "pixel_values", "num_images_per_sample")
        if layout.media == "grid_without_counts":
            media.pop("num_images_per_sample")
        if layout.media == "video":
            media.update(_grid_media(rows, "videos", "video_grid_thw", "pixel_values_videos", "num_videos_per_sample"))
        return media
    if layout.media == "per_image":
        images = [(row, index) for row in rows for index in range(len(row.images))]
        media = {"num_images_per_sample": torch.tensor([len(row.images) for row in rows])}
        if images:
            media["pixel_values"] = torch.stack([torch.full(IMAGE, row.tag + index / 10) for row, index in images])
            media["image_sizes"] = torch.tensor([[row.tag, index] for row, index in images])
        return media
    if layout.media == "sample_first":
        most = images_width or max(len(row.images) for row in rows)
        pixels = torch.zeros(len(rows), most, *IMAGE)
        pixel_mask = torch.zeros(len(rows), most, *IMAGE[1:], dtype=torch.long)
        for index, row in enumerate(rows):
            pixels[index, : len(row.images)] = row.tag
            pixel_mask[index, : len(row.images)] = 1
        return {
            "pixel_values": pixels,
            "pixel_attention_mask": pixel_mask,
            "num_images_per_sample": torch.tensor([len(row.images) for row in rows]),
        }
    return {}


def _grid_media(rows: list[Row], attribute: str, grid_key: str, pixel_key: str, count_key: str) -> dict:
    grids = [(row, index, grid) for row in rows for index, grid in enumerate(getattr(row, attribute))]
    patches = [torch.full((t * h * w, PATCH_DIM), row.tag + index / 10) for row, index, (t, h, w) in grids]
    media = {count_key: torch.tensor([len(getattr(row, attribute)) for row in rows])}
    if grids:
        media[pixel_key] = torch.cat(patches)
        media[grid_key] = torch.tensor([grid for _, _, grid in grids])
    return media


def rows_of(layout: Layout, seed: int, count: int = 6) -> list[Row]:
    """Rows with random lengths and media: several images per row, and rows with none."""
    rng = random.Random(seed)
    rows = []
    for tag in range(count):
        images: tuple = ()
        if layout.media in ("grid", "video", "per_image", "sample_first"):
            images = tuple((1, rng.choice([2, 4]), rng.choice([2, 4])) for _ in range(rng.choice([0, 1, 1, 2, 3])))
        elif layout.media == "grid_without_counts":
            images = ((1, rng.choice([2, 4]), 2),)
        videos = (
            tuple((2, 2, rng.choice([2, 4])) for _ in range(rng.choice([0, 1]))) if layout.media == "video" else ()
        )
        rows.append(Row(tag, rng.randint(2, 8), images, videos))
    if layout.media in ("per_image", "sample_first") and not any(row.images for row in rows):
        rows[0] = Row(0, rows[0].length, ((1, 2, 2),))
    return rows


def expected_slice(layout: Layout, rows: list[Row], begin: int, end: int) -> dict:
    """What the rows ``begin:end`` are: the collator's features for them alone; left padding keeps the
    batch's width (positions must not shift), and a slice without images carries no image keys."""
    width = build(layout, rows)["input_ids"].shape[1] if layout.padding == "left" else None
    expected = build(layout, rows[begin:end], width, images_width=max(len(row.images) for row in rows))
    for counts, keys in (
        ("num_images_per_sample", ("pixel_values", "image_grid_thw", "image_sizes")),
        ("num_videos_per_sample", ("pixel_values_videos", "video_grid_thw")),
    ):
        if layout.media not in ("sample_first",) and counts in expected and not expected[counts].any():
            for key in keys:
                expected.pop(key, None)
    return expected


def assert_same_features(actual: dict, expected: dict, context: str) -> None:
    assert actual.keys() == expected.keys(), f"{context}: keys {sorted(actual)} != {sorted(expected)}"
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert actual[key].dtype == value.dtype and torch.equal(actual[key], value), f"{context}: {key}"
        else:
            assert actual[key] == value, f"{context}: {key}"


CASES = [(layout, seed) for layout in LAYOUTS for seed in range(3)]


@pytest.mark.parametrize("layout, seed", CASES, ids=[f"{layout.name}-{seed}" for layout, seed in CASES])
def test_every_row_range_is_the_rows_rebuilt(layout, seed):
    rows = rows_of(layout, seed)
    features = build(layout, rows)
    cut = layout_of(features)
    for begin, end in itertools.combinations(range(len(rows) + 1), 2):
        expected = expected_slice(layout, rows, begin, end)
        assert_same_features(slice_rows(features, begin, end, cut), expected, f"rows {begin}:{end}")


@pytest.mark.parametrize(
    "layout", [layout for layout in LAYOUTS if layout.padding != "left"], ids=lambda layout: layout.name
)
def test_picked_rows_in_any_order_are_the_rows_rebuilt(layout):
    """The auto mode's probe embeds the longest rows, in any order: each picked row keeps its own pixels."""
    rows = rows_of(layout, seed=7)
    features = build(layout, rows)
    for picked in ([5, 1, 2], [3], [0, 1, 2, 3, 4, 5], [4, 0]):
        expected = build(layout, [rows[row] for row in picked], images_width=max(len(row.images) for row in rows))
        if layout.media in ("grid", "per_image") and not expected["num_images_per_sample"].any():
            continue
        assert_same_features(select_rows(features, picked), expected, f"rows {picked}")


def test_merged_passes_hold_every_segments_rows():
    """Text and per-row image columns may share a pass; each segment's rows are the rows rebuilt."""
    for layout in (LAYOUTS[0], LAYOUTS[2], LAYOUTS[3]):
        columns = [rows_of(layout, seed) for seed in (1, 2, 3)]
        features = [build(layout, rows) for rows in columns]
        layouts = [layout_of(column) for column in features]
        assert can_merge(features, layouts), layout.name
        plan = plan_minibatches(features, layouts, 4)
        assert plan.merged
        for minibatch in plan.minibatches:
            rows = [row for segment in minibatch for row in columns[segment.column][segment.begin : segment.end]]
            assert_same_features(
                minibatch_features(features, plan.layouts, minibatch), build(layout, rows), layout.name
            )


@pytest.mark.parametrize(
    "layout", [layout for layout in LAYOUTS if layout.media not in ("none", "per_row")], ids=lambda layout: layout.name
)
def test_columns_cut_per_image_are_embedded_apart(layout):
    """How a model batches images across columns is its own: such columns never share a pass."""
    features = [build(layout, rows_of(layout, seed)) for seed in (1, 2)]
    layouts = [layout_of(column) for column in features]
    assert not can_merge(features, layouts)
    assert not plan_minibatches(features, layouts, 4).merged


# ---------------------------------------------------------------------------------------------
# Upstream's own slicer


def upstream_slicer():
    """The installed release's ``_create_minibatch`` (5.4 on), or None."""
    for module in (
        "sentence_transformers.base.losses.gradcache",
        "sentence_transformers.sentence_transformer.losses.cached_multiple_negatives_ranking",
    ):
        try:
            return getattr(importlib.import_module(module), "_create_minibatch", None)
        except ImportError:
            continue
    return None


def handled_upstream(slicer, layout: Layout) -> bool:
    """Whether the installed release's slicer knows the layout: grids from 5.4, query expansion from 6.0,
    per-image keys from 6.2 (sample-first keys are cut by row, which every release does)."""
    source = inspect.getsource(inspect.getmodule(slicer))
    if layout.media in ("grid", "grid_without_counts", "video") and "image_grid_thw" not in source:
        return False
    if layout.media == "per_image" and "_IMAGE_AXIS_KEYS" not in source:
        return False
    return not layout.expansion or "query_expansion_positions" in source


def trimmed_like(upstream: dict, ours: dict) -> dict:
    """Upstream's slice cut to st_ext's width, after checking that what is cut is padding nobody scores."""
    if "attention_mask" not in ours or upstream["attention_mask"].shape == ours["attention_mask"].shape:
        return upstream
    width, full = ours["attention_mask"].shape[1], upstream["attention_mask"].shape[1]
    assert not upstream["attention_mask"][:, width:].any()
    trimmed = {}
    for key, value in upstream.items():
        is_token_axis = isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] == full
        trimmed[key] = value[:, :width] if is_token_axis and not key.startswith("pixel_") else value
    return trimmed


def without_empty_media(upstream: dict) -> dict:
    """Upstream's slice without the empty image tensors releases before 6.2 keep for rows without images
    (6.2 and st_ext leave those keys out: a model would be handed zero images)."""
    return {
        key: value
        for key, value in upstream.items()
        if not (isinstance(value, torch.Tensor) and value.numel() == 0 and is_media_key(key))
    }


@pytest.mark.parametrize("layout, seed", CASES, ids=[f"{layout.name}-{seed}" for layout, seed in CASES])
def test_every_row_range_is_what_upstreams_engine_embeds(layout, seed):
    slicer = upstream_slicer()
    if slicer is None:
        pytest.skip("this release slices inside each loss (every tensor by row), before images and flattening")
    if not handled_upstream(slicer, layout):
        pytest.skip(f"this release's slicer predates {layout.name}; the rows-rebuilt oracle covers it")
    rows = rows_of(layout, seed)
    features = build(layout, rows)
    cut = layout_of(features)
    for begin, end in itertools.combinations(range(len(rows) + 1), 2):
        ours = slice_rows(features, begin, end, cut)
        theirs = without_empty_media(trimmed_like(slicer(dict(features), begin, end), ours))
        assert_same_features(ours, theirs, f"rows {begin}:{end}")


# ---------------------------------------------------------------------------------------------
# Never a guess


@pytest.mark.parametrize("padding", ["right", "flattened"])
def test_a_key_no_rule_covers_stops_the_step_naming_it_and_the_module(model, padding):
    """A tensor whose first axis is not the rows (and, flattened, whose last is not the tokens) is refused."""
    columns = text_columns(6, 2)
    features = features_of(model, columns)
    features[1]["patch_embeddings"] = torch.zeros(11, 4)
    with pytest.raises(UnsliceableFeatureError, match=r"'patch_embeddings'.*\(11, 4\).*6 rows"):
        layout_of(features[1])
    loss = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2)
    with pytest.raises(UnsliceableFeatureError, match=r"'patch_embeddings'.*Transformer \(BertModel\)"):
        loss(features, None)
    if padding == "flattened":
        flat = build(LAYOUTS[2], rows_of(LAYOUTS[2], 0))
        flat["pixel_values"] = torch.zeros(11, PATCH_DIM)
        with pytest.raises(UnsliceableFeatureError, match="'pixel_values'"):
            layout_of(flat)


def test_grids_that_match_neither_the_counts_nor_the_rows_are_refused():
    """Upstream slices such pixels by row (the wrong patches); st_ext refuses them."""
    layout = LAYOUTS[6]
    rows = [Row(0, 3, ((1, 2, 2), (1, 2, 2))), Row(1, 4, ((1, 2, 2),)), Row(2, 2, ((1, 4, 2),))]
    features = build(layout, rows)  # four grid rows for three rows, and no counts
    with pytest.raises(UnsliceableFeatureError, match="'pixel_values'"):
        layout_of(features)


def test_slicing_reads_each_column_from_the_device_once():
    """Media counts are read with the layout; cutting afterwards reads nothing back."""
    layout = LAYOUTS[7]
    features = build(layout, rows_of(layout, 0))
    cut = layout_of(features)
    guarded = {
        key: value.as_subclass(NoDeviceReads) if torch.is_tensor(value) else value for key, value in features.items()
    }
    for begin, end in [(0, 2), (2, 6), (1, 5)]:
        slice_rows(guarded, begin, end, cut)
