"""Flattened (unpadded) inputs: every cached path gives the padded path's loss and gradients.

The flattening model attends through a plain-torch variable-length attention (``varlen_attention``),
so a wrong sequence boundary changes its embeddings: equal results mean the boundaries were right.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from loss_checks import assert_same_grads, guide_from, loss_and_grads, pair_dataset, text_columns
from tiny_models import SENTENCES, sentence_transformer_from
from varlen_attention import flattening_supported, make_flattening

from st_ext import losses
from st_ext._compat import preprocess, st_losses
from st_ext.losses.cross_batch_memory import CrossBatchMemoryLoss
from st_ext.losses.features import batch_size_of, is_flattened, layout_of, row_keys, select_rows, slice_rows, to_padded
from st_ext.losses.frozen_encoders import combined_row_keys, decoded_texts
from st_ext.losses.memory_bank import document_keys
from st_ext.losses.minibatches import plan_minibatches

pytestmark = [
    pytest.mark.conformance,
    pytest.mark.skipif(not flattening_supported(), reason="sentence-transformers flattens inputs from 5.4 on"),
    pytest.mark.usefixtures("one_torch_thread"),
]

upstream = st_losses()
DIMS = [32, 16, 8]
BATCH = 8


@pytest.fixture
def flat_model(tiny_bert_dir):
    return make_flattening(sentence_transformer_from(tiny_bert_dir))


@pytest.fixture
def flat_guide(guide_dir):
    return make_flattening(guide_from(guide_dir))


def assert_same_as_padded(padded_model, padded_loss, flat_model, flat_loss, columns):
    """Same loss and gradients on flattened inputs as on padded ones (dropout off: the layouts draw
    different dropout masks)."""
    assert is_flattened(preprocess(flat_model, columns[0]))
    assert not is_flattened(preprocess(padded_model, columns[0]))
    assert_same_grads(
        loss_and_grads(flat_model, flat_loss, columns, train=False),
        loss_and_grads(padded_model, padded_loss, columns, train=False),
    )


def test_the_model_consumes_flattened_inputs(model, flat_model):
    """Boundaries matter to the varlen attention: merged into one sequence, the embeddings change."""
    model.eval()
    flat_model.eval()
    features = preprocess(flat_model, SENTENCES)
    assert "attention_mask" not in features and features["input_ids"].shape[0] == 1
    with torch.no_grad():
        padded = model(preprocess(model, SENTENCES))["sentence_embedding"]
        flattened = flat_model(dict(features))["sentence_embedding"]
        merged = dict(features, cu_seq_lens_q=features["cu_seq_lens_q"][[0, -1]])
        merged.update(cu_seq_lens_k=merged["cu_seq_lens_q"], seq_idx=torch.zeros_like(features["seq_idx"]))
        one_sequence = flat_model(merged)["sentence_embedding"]
    torch.testing.assert_close(flattened, padded, rtol=1e-5, atol=1e-6)
    assert one_sequence.shape[0] == 1 and not torch.allclose(one_sequence[0], padded.mean(0), atol=1e-3)


def test_rows_slices_and_keys_match_the_padded_layout(model, flat_model):
    flat = preprocess(flat_model, SENTENCES)
    padded = preprocess(model, SENTENCES)
    assert batch_size_of(flat) == batch_size_of(padded) == len(SENTENCES)
    assert row_keys(flat) == row_keys(padded)
    assert combined_row_keys([flat, flat]) == combined_row_keys([padded, padded])
    assert torch.equal(document_keys(flat), document_keys(padded))
    assert decoded_texts(flat, model.tokenizer) == decoded_texts(padded, model.tokenizer)
    assert column_ranges(flat, 3, 20) == column_ranges(padded, 3, 20)
    assert column_ranges(flat, 3) == [(0, 3), (3, 6), (6, 8)]
    for rows, sliced in [([2, 3, 4], slice_rows(flat, 2, 5, layout_of(flat))), ([5, 1], select_rows(flat, [5, 1]))]:
        expected = preprocess(flat_model, [SENTENCES[row] for row in rows])
        assert sliced.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(sliced[key], value) if isinstance(value, torch.Tensor) else sliced[key] == value, key
    repadded = to_padded(flat)
    assert torch.equal(repadded["input_ids"], padded["input_ids"])
    assert torch.equal(repadded["attention_mask"].bool(), padded["attention_mask"].bool())


def column_ranges(features, size, num_tokens=None):
    return plan_minibatches([features], [layout_of(features)], size, num_tokens).column_ranges()[0]


def test_slices_are_copies(flat_model, model):
    """A module editing its mini-batch in place must not change the batch another pass slices again."""
    for features in (preprocess(flat_model, SENTENCES), preprocess(model, SENTENCES)):
        before = {key: value.clone() for key, value in features.items() if isinstance(value, torch.Tensor)}
        for value in slice_rows(features, 0, 4, layout_of(features)).values():
            if isinstance(value, torch.Tensor):
                value.zero_()
        for key, value in before.items():
            assert torch.equal(features[key], value), key


@pytest.mark.parametrize("num_columns", [2, 3], ids=["pairs", "hard-negatives"])
def test_cached_matryoshka_equals_the_padded_path(model, flat_model, num_columns):
    columns = text_columns(BATCH, num_columns)

    def loss_for(m):
        return losses.MatryoshkaLoss(m, upstream.CachedMultipleNegativesRankingLoss(m, mini_batch_size=3), DIMS)

    assert_same_as_padded(model, loss_for(model), flat_model, loss_for(flat_model), columns)


def test_dropout_is_replayed_on_flattened_inputs(flat_model):
    """With dropout on, the cached loss's second pass must draw the first pass's masks on flattened rows too."""
    columns = text_columns(BATCH, 2)
    cached = losses.MatryoshkaLoss(
        flat_model, upstream.CachedMultipleNegativesRankingLoss(flat_model, mini_batch_size=BATCH), DIMS
    )
    reference = upstream.MatryoshkaLoss(flat_model, upstream.MultipleNegativesRankingLoss(flat_model), DIMS)
    assert_same_grads(
        loss_and_grads(flat_model, cached, columns, train=True),
        loss_and_grads(flat_model, reference, columns, train=True),
    )


@pytest.mark.parametrize("guide_kind", ["flattening", "padded", "retokenizing"])
@pytest.mark.parametrize("token_budget", [None, 40], ids=["rows", "tokens"])
def test_cached_gist_equals_the_padded_path(model, flat_model, guide_dir, flat_guide, guide_kind, token_budget):
    """The guide reads flattened rows directly, gets them padded, or re-tokenizes their decoded texts."""
    columns = text_columns(BATCH, 3)
    guide = {"flattening": flat_guide, "padded": guide_from(guide_dir), "retokenizing": guide_from(guide_dir, 16)}
    reference_guide = guide_from(guide_dir, 16 if guide_kind == "retokenizing" else None)

    def loss_for(m, g):
        inner = losses.CachedGISTEmbedLoss(m, g, mini_batch_size=3, mini_batch_num_tokens=token_budget)
        return losses.MatryoshkaLoss(m, inner, DIMS)

    assert_same_as_padded(
        model, loss_for(model, reference_guide), flat_model, loss_for(flat_model, guide[guide_kind]), columns
    )


def test_non_cached_gist_pads_for_a_padded_guide(model, flat_model, guide_dir):
    columns = text_columns(BATCH, 2)
    assert_same_as_padded(
        model,
        losses.GISTEmbedLoss(model, guide_from(guide_dir)),
        flat_model,
        losses.GISTEmbedLoss(flat_model, guide_from(guide_dir)),
        columns,
    )


def test_precomputed_guide_keys_flattened_rows(flat_model, guide):
    columns = text_columns(BATCH, 2)
    table = losses.GuideEmbeddings.from_dataset(flat_model, guide, pair_dataset(BATCH), show_progress_bar=False)
    table = table.extended_with(
        losses.GuideEmbeddings.from_texts(flat_model, guide, [t for c in columns for t in c], show_progress_bar=False)
    )
    live = losses.CachedGISTEmbedLoss(flat_model, guide, mini_batch_size=3)
    precomputed = losses.CachedGISTEmbedLoss(flat_model, None, mini_batch_size=3, guide_embeddings=table)
    assert_same_grads(
        loss_and_grads(flat_model, precomputed, columns, train=False),
        loss_and_grads(flat_model, live, columns, train=False),
    )


def test_cross_batch_memory_equals_the_padded_path(model, flat_model):
    """Two steps: the second ranks against the first step's queued documents, matched by token-id keys."""
    first, second = text_columns(BATCH, 2, seed=1), text_columns(BATCH, 2, seed=2)
    second[1][0] = first[1][0]  # a queued copy of an anchor's own positive is masked by its key

    def run(m):
        loss = CrossBatchMemoryLoss(m, upstream.CachedMultipleNegativesRankingLoss(m, mini_batch_size=3), 32)
        loss_and_grads(m, loss, first, train=False)
        return loss_and_grads(m, loss, second, train=False)

    assert_same_grads(run(flat_model), run(model))


def test_auto_mini_batch_size_measures_flattened_rows(model, flat_model):
    """Auto sizing measures flattened rows (merged across columns, longest first) and the sized loss
    equals the padded path."""
    columns = text_columns(BATCH, 2)

    def auto(m):
        return losses.CachedMultipleNegativesRankingLoss(m, mini_batch_size="auto", memory_budget_mb=0.5)

    flat_loss = auto(flat_model)
    assert_same_as_padded(model, auto(model), flat_model, flat_loss, columns)
    choice = flat_loss.auto_mini_batch.choice
    assert 1 <= choice.size < 2 * BATCH and all(peak > 0 for peak in choice.tried.values()), choice


def test_merged_mini_batches_equal_the_padded_path(model, flat_model):
    """Mini-batches of 5 rows cut across the two columns: boundaries and row numbers are rebuilt across them."""
    columns = text_columns(BATCH, 2)
    assert_same_as_padded(
        model,
        losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=5),
        flat_model,
        losses.CachedMultipleNegativesRankingLoss(flat_model, mini_batch_size=5),
        columns,
    )


def test_distillation_teacher_live_and_precomputed_on_flattened_rows(model, flat_model, guide_dir):
    """A MarginMSE teacher reads flattened rows (padded for it) and its precomputed labels key them."""
    columns = text_columns(BATCH, 3)
    dataset = Dataset.from_dict({"anchor": columns[0], "positive": columns[1], "negative_1": columns[2]})

    def live(m):
        return losses.DistillationLoss(upstream.MarginMSELoss(m), guide_from(guide_dir))

    assert_same_as_padded(model, live(model), flat_model, live(flat_model), columns)
    inner = upstream.MarginMSELoss(flat_model)
    table = losses.TeacherLabels.from_dataset(
        flat_model, guide_from(guide_dir), inner, dataset, batch_size=3, show_progress_bar=False
    )
    assert_same_grads(
        loss_and_grads(flat_model, losses.DistillationLoss(inner, teacher_labels=table), columns, train=False),
        loss_and_grads(flat_model, live(flat_model), columns, train=False),
    )
