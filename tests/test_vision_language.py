"""Images through the cached losses: every mini-batch embeds its own rows' images.

The tiny Qwen2-VL flattens all images of a column into one ``pixel_values`` tensor of patches, cut
per image by ``image_grid_thw`` and per row by ``num_images_per_sample``; its rows hold 0, 1 or 2
images of different sizes, and one mini-batch holds no image at all. A mini-batch that slices pixels
by row, or counts a row's images wrong, embeds other rows' pixels or fails on shapes, so the cached
losses giving the uncached loss's value and gradients means each mini-batch got its own images. The
tiny CLIP covers the other layout, one ``(C, H, W)`` image per row. Neither model has dropout, so
train mode compares like with like across mini-batch boundaries.
"""

from __future__ import annotations

import inspect

import pytest

from st_ext._compat import st_modules

if not hasattr(st_modules().Transformer, "modalities"):
    pytest.skip(
        "this sentence-transformers' Transformer module takes text only (no multimodal preprocess)",
        allow_module_level=True,
    )

from loss_checks import assert_losses_agree, features_of, random_texts  # noqa: E402
from tiny_vlm import (  # noqa: E402
    MERGE_SIZE,
    PATCH_SIZE,
    TEMPORAL_PATCH_SIZE,
    noise_image,
    save_tiny_clip,
    save_tiny_qwen2_vl,
)

from st_ext import SentenceTransformer, losses  # noqa: E402
from st_ext._compat import HAS_MULTI_VECTOR_ENCODER, preprocess, st_losses  # noqa: E402

pytestmark = [pytest.mark.conformance, pytest.mark.usefixtures("one_torch_thread")]

upstream = st_losses()
BATCH = 6
MINI_BATCH = 2
DIMS = [32, 16, 8]
#: One flattened patch: RGB, TEMPORAL_PATCH_SIZE frames, PATCH_SIZE x PATCH_SIZE pixels.
PATCH_DIM = 3 * TEMPORAL_PATCH_SIZE * PATCH_SIZE * PATCH_SIZE


@pytest.fixture(scope="module")
def qwen2_vl_dir(tmp_path_factory):
    return save_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny_qwen2_vl"))


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return save_tiny_clip(tmp_path_factory.mktemp("tiny_clip"))


@pytest.fixture(scope="module")
def vlm(qwen2_vl_dir):
    """The tiny Qwen2-VL as a SentenceTransformer (Transformer + mean Pooling); no test changes its weights.

    The tests need what 6.2 gives: a column mixing texts, images and both, rows without images among
    them, and ``num_images_per_sample`` (without it, a row's patches cannot be told from the next row's:
    st_ext refuses such batches). Releases or transformers versions that lack one skip, saying which.
    """
    model = SentenceTransformer(str(qwen2_vl_dir), device="cpu")
    try:
        features = preprocess(model, mixed_column(random_texts(BATCH, seed=7, max_words=8)))
    except (ValueError, TypeError) as error:
        pytest.skip(f"this sentence-transformers/transformers cannot preprocess a mixed image column: {error}")
    if "num_images_per_sample" not in features:
        pytest.skip("this sentence-transformers does not count images per row (num_images_per_sample)")
    return model


@pytest.fixture(scope="module")
def clip(clip_dir):
    return SentenceTransformer(str(clip_dir), device="cpu")


def mixed_column(texts: list[str]) -> list:
    """Rows with 2, 1, 0, 0, 2 and 1 images of different sizes, as a multimodal dict, a bare image, text
    and a dict with one image: sentence-transformers renders a column that mixes them as chat messages.
    With mini-batches of 2 rows, the middle mini-batch holds no image and the others three each."""
    return [
        {"text": texts[0], "image": [noise_image(8, 8, 1), noise_image(16, 8, 2)]},
        noise_image(16, 16, 3),
        texts[2],
        texts[3],
        {"text": texts[4], "image": [noise_image(8, 16, 4), noise_image(16, 16, 5)]},
        {"text": texts[5], "image": noise_image(8, 8, 6)},
    ]


def message_column(texts: list[str]) -> list:
    """Chat messages written out, with 1, 0, 2, 1, 0 and 1 images (the images before the text)."""
    counts = [1, 0, 2, 1, 0, 1]
    sizes = [(16, 8), (8, 8), (16, 16), (8, 16)]
    rows = []
    for row, (text, count) in enumerate(zip(texts, counts)):
        content = [
            {"type": "image", "image": noise_image(*sizes[(row + i) % len(sizes)], seed=100 + 10 * row + i)}
            for i in range(count)
        ]
        rows.append([{"role": "user", "content": content + [{"type": "text", "text": text}]}])
    return rows


def vlm_columns(num_columns: int) -> list[list]:
    """(text anchor, mixed positive[, message negative]) columns, all texts distinct."""
    texts = random_texts(BATCH * 3, seed=7, max_words=8)
    anchors, positives, negatives = (texts[i * BATCH : (i + 1) * BATCH] for i in range(3))
    columns = [anchors, mixed_column(positives), message_column(negatives)]
    return columns[:num_columns]


def clip_columns() -> list[list]:
    """(text anchor, image positive, image negative): CLIP takes one modality per column."""
    texts = random_texts(BATCH, seed=11, max_words=8)
    positives = [noise_image(8 + 4 * (row % 3), 16, seed=200 + row) for row in range(BATCH)]
    negatives = [noise_image(16, 8 + 8 * (row % 2), seed=300 + row) for row in range(BATCH)]
    return [texts, positives, negatives]


COLUMNS = [pytest.param(2, id="pairs"), pytest.param(3, id="message-negatives")]


def test_preprocess_flattens_patches_and_counts_images_per_row(vlm):
    """The layout the other tests rely on: 0, 1 and 2 images per row in one flattened pixel tensor."""
    rows = [
        "the cat is in the house",
        noise_image(16, 16, 1),
        {"text": "a dog on the road", "image": [noise_image(8, 8, 2), noise_image(16, 8, 3)]},
    ]
    features = preprocess(vlm, rows)
    assert features["modality"] == "message"
    assert features["num_images_per_sample"].tolist() == [0, 1, 2]
    assert features["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 2], [1, 2, 4]]
    assert features["pixel_values"].shape == (16 + 4 + 8, PATCH_DIM)
    width = features["input_ids"].shape[1]
    assert features["attention_mask"].shape == features["mm_token_type_ids"].shape == (3, width)
    # One placeholder token per MERGE_SIZE x MERGE_SIZE patches, in the row that holds the image.
    placeholders = (features["input_ids"] == vlm[0].processor.image_token_id).sum(dim=1)
    assert placeholders.tolist() == [0, 16 // MERGE_SIZE**2, (4 + 8) // MERGE_SIZE**2]


def test_text_only_column_has_no_pixels(vlm):
    features = preprocess(vlm, ["the cat is in the house", "a dog on the road"])
    assert not {"pixel_values", "image_grid_thw", "num_images_per_sample"} & features.keys()


@pytest.mark.parametrize("num_columns", COLUMNS)
def test_upstream_cached_mnrl_matches_uncached(vlm, num_columns):
    """The premise: upstream's own cached loss slices these batches per image and agrees with the uncached one."""
    cached = upstream.CachedMultipleNegativesRankingLoss(vlm, mini_batch_size=MINI_BATCH)
    reference = upstream.MultipleNegativesRankingLoss(vlm)
    assert_losses_agree(vlm, cached, reference, vlm_columns(num_columns), train=True)


@pytest.mark.parametrize("num_columns", COLUMNS)
def test_cached_mnrl_matches_uncached(vlm, num_columns):
    cached = losses.CachedMultipleNegativesRankingLoss(vlm, mini_batch_size=MINI_BATCH)
    reference = upstream.MultipleNegativesRankingLoss(vlm)
    assert_losses_agree(vlm, cached, reference, vlm_columns(num_columns), train=True)


def test_cached_matryoshka_matches_uncached(vlm):
    inner = losses.CachedMultipleNegativesRankingLoss(vlm, mini_batch_size=MINI_BATCH)
    cached = losses.MatryoshkaLoss(vlm, inner, DIMS)
    reference = upstream.MatryoshkaLoss(vlm, upstream.MultipleNegativesRankingLoss(vlm), DIMS)
    assert_losses_agree(vlm, cached, reference, vlm_columns(3), train=True)


def test_clip_preprocess_gives_one_image_per_row(clip):
    features = preprocess(clip, clip_columns()[1])
    assert features["pixel_values"].shape == (BATCH, 3, 16, 16)
    assert features["modality"] == "image"


@pytest.mark.parametrize(
    "cached_class",
    [
        pytest.param(upstream.CachedMultipleNegativesRankingLoss, id="upstream"),
        pytest.param(losses.CachedMultipleNegativesRankingLoss, id="st_ext"),
    ],
)
def test_clip_cached_mnrl_matches_uncached(clip, cached_class):
    cached = cached_class(clip, mini_batch_size=MINI_BATCH)
    reference = upstream.MultipleNegativesRankingLoss(clip)
    assert_losses_agree(clip, cached, reference, clip_columns(), train=True)


@pytest.mark.skipif(not HAS_MULTI_VECTOR_ENCODER, reason="MultiVectorEncoder arrived in sentence-transformers 6.0")
@pytest.mark.usefixtures("vlm")  # the release counts images per row
def test_multi_vector_cached_mnrl_matches_uncached_on_images(qwen2_vl_dir):
    """st_ext's MultiVectorEncoder with images: upstream's cached late-interaction loss (st_ext has no
    cached multi-vector loss of its own) gives the uncached loss's value and gradients."""
    from sentence_transformers.multi_vector_encoder.losses import (
        CachedMultiVectorMultipleNegativesRankingLoss,
        MultiVectorMultipleNegativesRankingLoss,
    )

    from st_ext import MultiVectorEncoder

    model = MultiVectorEncoder(str(qwen2_vl_dir), device="cpu")
    features = preprocess(model, vlm_columns(2)[1])
    assert features["num_images_per_sample"].tolist() == [2, 1, 0, 0, 2, 1]
    cached = CachedMultiVectorMultipleNegativesRankingLoss(model, mini_batch_size=MINI_BATCH)
    reference = MultiVectorMultipleNegativesRankingLoss(model)
    assert_losses_agree(model, cached, reference, vlm_columns(3), train=True)


@pytest.fixture(scope="module")
def vlm_guide(qwen2_vl_dir):
    """A second instance of the tiny Qwen2-VL, frozen: a GIST guide that reads the same image features."""
    return SentenceTransformer(str(qwen2_vl_dir), device="cpu").eval()


PATHS = {
    "symmetric": (
        lambda m, g: losses.CachedMultipleNegativesSymmetricRankingLoss(m, mini_batch_size=MINI_BATCH),
        lambda m, g: upstream.MultipleNegativesSymmetricRankingLoss(m),
        2,
    ),
    "gist": (
        lambda m, g: losses.CachedGISTEmbedLoss(m, g, mini_batch_size=MINI_BATCH),
        lambda m, g: upstream.GISTEmbedLoss(m, g),
        3,
    ),
    "matryoshka-gist": (
        lambda m, g: losses.MatryoshkaLoss(m, losses.CachedGISTEmbedLoss(m, g, mini_batch_size=MINI_BATCH), DIMS),
        lambda m, g: upstream.MatryoshkaLoss(m, upstream.GISTEmbedLoss(m, g), DIMS),
        3,
    ),
}
if "mini_batch_num_tokens" in inspect.signature(upstream.CachedMultipleNegativesRankingLoss).parameters:
    PATHS["token-budget"] = (
        lambda m, g: losses.CachedMultipleNegativesRankingLoss(m, mini_batch_size=BATCH, mini_batch_num_tokens=40),
        lambda m, g: upstream.MultipleNegativesRankingLoss(m),
        3,
    )


@pytest.mark.parametrize("path", PATHS)
def test_every_cached_path_matches_uncached_on_images(vlm, vlm_guide, path):
    """The guide's pass, the symmetric loss, Matryoshka and token budgets cut images with the same rules."""
    build_cached, build_reference, num_columns = PATHS[path]
    cached, reference = build_cached(vlm, vlm_guide), build_reference(vlm, vlm_guide)
    assert_losses_agree(vlm, cached, reference, vlm_columns(num_columns), train=True)


def test_auto_probe_rows_keep_their_images(vlm):
    """``mini_batch_size="auto"`` measures the longest rows, picked out of order: each keeps its own images."""
    columns = vlm_columns(3)
    loss = losses.CachedMultipleNegativesRankingLoss(vlm, mini_batch_size="auto", memory_budget_mb=1)
    assert_losses_agree(vlm, loss, upstream.MultipleNegativesRankingLoss(vlm), columns, train=True)
    assert {1, 2, 4} <= set(loss.auto_mini_batch.choice.tried), "the probe measured rows picked out of order"


def test_rows_with_the_same_text_and_other_images_get_other_keys(vlm, clip):
    """Cross-batch memory and precomputed tables key rows by content: images are part of it."""
    from st_ext.losses.features import row_keys

    same, other = noise_image(16, 16, 1), noise_image(16, 16, 2)
    rows = [{"text": "a cat", "image": same}, {"text": "a cat", "image": other}, {"text": "a cat", "image": same}]
    keys = row_keys(preprocess(vlm, rows))
    assert keys[0] == keys[2] and keys[0] != keys[1]
    clip_keys = row_keys(preprocess(clip, [same, other, same]))
    assert clip_keys[0] == clip_keys[2] and clip_keys[0] != clip_keys[1]


def test_cross_batch_memory_over_the_cached_loss_matches_over_the_uncached_one(vlm):
    """Cross-batch memory cuts and keys image rows as the cached loss does: the same values and gradients
    as over the uncached loss, with a queue filled by earlier image batches."""
    from st_ext.losses.cross_batch_memory import CrossBatchMemoryLoss

    def filled(inner):
        memory = CrossBatchMemoryLoss(vlm, inner, memory_size=32)
        memory(features_of(vlm, vlm_columns(2)), None).backward()
        vlm.zero_grad(set_to_none=True)
        return memory

    cached = filled(losses.CachedMultipleNegativesRankingLoss(vlm, mini_batch_size=MINI_BATCH))
    reference = filled(upstream.MultipleNegativesRankingLoss(vlm))
    assert len(cached.memory_embeddings) == BATCH
    assert_losses_agree(vlm, cached, reference, vlm_columns(3), train=True)
