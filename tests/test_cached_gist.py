"""Cached GIST: upstream's gradients, under Matryoshka too, with a live, offloaded or precomputed guide."""

from __future__ import annotations

import contextlib
import copy
import inspect

import pytest
import sentence_transformers
import torch
from loss_checks import (
    assert_losses_agree,
    assert_same_grads,
    features_of,
    grads_differ,
    guide_from,
    loss_and_grads,
    pair_dataset,
    peak_training_bytes,
    text_columns,
)
from tiny_models import sentence_transformer_from

import st_ext.offload
from st_ext import losses
from st_ext._compat import st_losses

upstream = st_losses()
DIMS = [32, 16, 8]
BATCH = 8
SETTINGS = [pytest.param(False, 3, id="eval-3-minibatches"), pytest.param(True, BATCH, id="dropout-replayed")]
COLUMNS = [pytest.param(2, id="pairs"), pytest.param(3, id="hard-negative")]


@pytest.mark.parametrize("train, mini_batch_size", SETTINGS)
@pytest.mark.parametrize("num_columns", COLUMNS)
def test_matches_upstream_gist(model, guide, train, mini_batch_size, num_columns):
    columns = text_columns(BATCH, num_columns)
    cached = losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=mini_batch_size)
    reference = upstream.GISTEmbedLoss(model, guide)
    assert_losses_agree(model, cached, reference, columns, train=train)


def test_token_budget_mini_batches_match_upstream(model, guide):
    columns = text_columns(BATCH, 2)
    cached = losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=3, mini_batch_num_tokens=24)
    assert_losses_agree(model, cached, upstream.GISTEmbedLoss(model, guide), columns, train=False)


@pytest.mark.parametrize("margin_strategy, margin", [("absolute", 0.05), ("relative", 0.05)])
def test_margins_match_upstream(model, guide, margin_strategy, margin):
    columns = text_columns(BATCH, 3)
    options = dict(margin_strategy=margin_strategy, margin=margin)
    cached = losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=3, **options)
    reference = upstream.GISTEmbedLoss(model, guide, **options)
    result = loss_and_grads(model, cached, columns, train=False)
    assert_same_grads(result, loss_and_grads(model, reference, columns, train=False))
    no_margin = losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=3)
    assert grads_differ(result, loss_and_grads(model, no_margin, columns, train=False))


@pytest.mark.skipif(
    "contrast_anchors" not in inspect.signature(upstream.GISTEmbedLoss).parameters,
    reason="this sentence-transformers' GISTEmbedLoss always contrasts anchors and positives",
)
@pytest.mark.parametrize("anchors, positives", [(False, True), (True, False), (False, False)])
def test_contrast_options_match_upstream(model, guide, anchors, positives):
    columns = text_columns(BATCH, 2)
    options = dict(contrast_anchors=anchors, contrast_positives=positives)
    cached = losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=3, **options)
    reference = upstream.GISTEmbedLoss(model, guide, **options)
    assert_losses_agree(model, cached, reference, columns, train=False)


@pytest.mark.parametrize("train, mini_batch_size", SETTINGS)
@pytest.mark.parametrize("num_columns", COLUMNS)
@pytest.mark.parametrize("implementation", ["st_ext", "upstream"])
def test_matryoshka_over_cached_gist_matches_non_cached(
    model, guide, train, mini_batch_size, num_columns, implementation
):
    """The guide's similarities are never truncated: only the trained model's embeddings are."""
    columns = text_columns(BATCH, num_columns)
    loss_class = losses.CachedGISTEmbedLoss if implementation == "st_ext" else upstream.CachedGISTEmbedLoss
    inner = loss_class(model, guide, mini_batch_size=mini_batch_size)
    cached = losses.MatryoshkaLoss(model, inner, DIMS, [1.0, 0.5, 0.25])
    reference = upstream.MatryoshkaLoss(model, upstream.GISTEmbedLoss(model, guide), DIMS, [1.0, 0.5, 0.25])
    assert_losses_agree(model, cached, reference, columns, train=train)
    assert "calculate_loss" not in vars(inner)


# --------------------------------------------------------------------------------------------
# Precomputed guide embeddings


def live_and_precomputed(model, guide, columns, **options):
    table = losses.GuideEmbeddings.from_texts(model, guide, [text for column in columns for text in column])
    live = losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=3, **options)
    precomputed = losses.CachedGISTEmbedLoss(model, None, mini_batch_size=3, guide_embeddings=table, **options)
    return live, precomputed


@pytest.mark.parametrize("num_columns", COLUMNS)
@pytest.mark.parametrize("guide_length", [None, 12], ids=["same-tokens", "retokenized"])
def test_precomputed_guide_equals_live_guide(model, guide_dir, num_columns, guide_length):
    """A guide with a shorter max_seq_length reads decoded and re-tokenized texts; the table must too."""
    guide = guide_from(guide_dir, max_seq_length=guide_length)
    columns = text_columns(BATCH, num_columns, max_words=18)
    live, precomputed = live_and_precomputed(model, guide, columns)
    assert (live.retokenize_with is not None) == (guide_length is not None)
    live_result = loss_and_grads(model, live, columns, train=True)
    assert_same_grads(loss_and_grads(model, precomputed, columns, train=True), live_result)
    assert_same_grads(
        loss_and_grads(model, losses.MatryoshkaLoss(model, precomputed, DIMS), columns, train=True),
        loss_and_grads(model, losses.MatryoshkaLoss(model, live, DIMS), columns, train=True),
    )


def test_precomputed_from_dataset_and_saved_table(model, guide, tmp_path):
    dataset = pair_dataset(BATCH, negatives=1).add_column("label", [1.0] * BATCH)
    table = losses.GuideEmbeddings.from_dataset(model, guide, dataset, show_progress_bar=False)
    assert len(table) == 3 * BATCH
    table.save(tmp_path / "guide.pt")
    loaded = losses.GuideEmbeddings.load(tmp_path / "guide.pt")
    columns = [dataset[name] for name in ("anchor", "positive", "negative_1")]
    live = losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=3)
    precomputed = losses.CachedGISTEmbedLoss(model, guide_embeddings=loaded, mini_batch_size=3)
    assert_losses_agree(model, precomputed, live, columns, train=False)


def test_table_from_offload_precompute_embeddings(model, guide):
    dataset = pair_dataset(BATCH)
    filled = st_ext.offload.precompute_embeddings(guide, dataset, ["anchor", "positive"], show_progress_bar=False)
    table = losses.GuideEmbeddings.from_precomputed(model, filled)
    columns = [dataset["anchor"], dataset["positive"]]
    live = losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=3)
    precomputed = losses.CachedGISTEmbedLoss(model, guide_embeddings=table, mini_batch_size=3)
    assert_losses_agree(model, precomputed, live, columns, train=False)


def test_rows_missing_from_the_table(model, guide):
    known, unknown = text_columns(BATCH, 2, seed=1), text_columns(BATCH, 2, seed=2)
    table = losses.GuideEmbeddings.from_texts(model, guide, known[0] + known[1], show_progress_bar=False)
    without_guide = losses.CachedGISTEmbedLoss(model, guide_embeddings=table, mini_batch_size=3)
    with pytest.raises(KeyError, match=f"{2 * BATCH} row\\(s\\) of this batch are not in the precomputed guide"):
        without_guide(features_of(model, unknown), None)
    with_fallback = losses.CachedGISTEmbedLoss(model, guide, guide_embeddings=table, mini_batch_size=3)
    live = losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=3)
    assert_losses_agree(model, with_fallback, live, unknown, train=False)


# --------------------------------------------------------------------------------------------
# Offloaded guide


@contextlib.contextmanager
def recording_on_device(calls, original):
    @contextlib.contextmanager
    def record(module, device, **kwargs):
        calls.append((module, torch.device(device)))
        with original(module, device, **kwargs):
            yield module

    yield record


def test_offloaded_guide_moves_in_only_for_its_pass(model, guide, monkeypatch):
    calls = []
    with recording_on_device(calls, st_ext.offload.on_device) as record:
        monkeypatch.setattr(st_ext.offload, "on_device", record)
        offloaded = losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=3, offload_guide=True)
        assert guide not in list(offloaded.modules())
        assert not any(p.requires_grad for p in guide.parameters())
        columns = text_columns(BATCH, 2)
        result = loss_and_grads(model, offloaded, columns, train=False)
    assert [module for module, _ in calls] == [guide]
    live = losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=3)
    assert_same_grads(result, loss_and_grads(model, live, columns, train=False))


@pytest.mark.cuda
def test_offloaded_guide_stays_on_cpu_between_steps(tiny_bert_dir, guide_dir):
    model = sentence_transformer_from(tiny_bert_dir).to("cuda")
    guide = guide_from(guide_dir)
    offloaded = losses.MatryoshkaLoss(
        model, losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=3, offload_guide=True), DIMS
    ).to("cuda")
    columns = text_columns(BATCH, 2)
    features = [
        {k: v.to("cuda") if torch.is_tensor(v) else v for k, v in f.items()} for f in features_of(model, columns)
    ]
    offloaded(features, None).backward()
    assert {p.device.type for p in guide.parameters()} == {"cpu"}
    assert all(p.grad is not None for name, p in model.named_parameters() if "pooler" not in name)


# --------------------------------------------------------------------------------------------
# Memory (CPU, st_ext.memory's profiler meter)


def test_peak_memory_does_not_grow_with_batch_size(tiny_bert6_dir, guide):
    model = sentence_transformer_from(tiny_bert6_dir).train()
    cached = losses.MatryoshkaLoss(model, losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=16), [64, 32, 16])
    small = text_columns(16, 2, seed=16, min_words=10, max_words=16)
    large = text_columns(128, 2, seed=128, min_words=10, max_words=16)
    small_peak, large_peak = peak_training_bytes(model, cached, small), peak_training_bytes(model, cached, large)
    assert large_peak <= 1.25 * small_peak, (small_peak, large_peak)


# --------------------------------------------------------------------------------------------
# Errors, model card, training


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(guide=None), TypeError, "needs a guide model, or precomputed guide_embeddings"),
        (dict(temperature=0.0), ValueError, "temperature must be > 0"),
        (dict(margin_strategy="percent"), ValueError, "margin_strategy must be 'absolute' or 'relative'"),
        (dict(guide=None, guide_embeddings={}), TypeError, "must be a GuideEmbeddings table"),
        (dict(mini_batch_size=0), ValueError, "mini_batch_size must be a positive integer"),
        (dict(mini_batch_num_tokens=-5), ValueError, "mini_batch_num_tokens must be a positive integer"),
    ],
)
def test_bad_arguments(model, guide, kwargs, error, message):
    kwargs = {"guide": guide, **kwargs}
    with pytest.raises(error, match=message):
        losses.CachedGISTEmbedLoss(model, **kwargs)


def test_offloading_the_model_itself_is_refused(model):
    empty_table = losses.GuideEmbeddings({}, torch.empty(0, 32))
    with pytest.raises(ValueError, match="offload_guide=True needs a guide"):
        losses.CachedGISTEmbedLoss(model, None, guide_embeddings=empty_table, offload_guide=True)
    with pytest.raises(ValueError, match="guided by the model itself"):
        losses.CachedGISTEmbedLoss(model, model, offload_guide=True)
    with pytest.raises(ValueError, match="shares its parameters"):
        losses.CachedGISTEmbedLoss(model, copy.copy(model), offload_guide=True)
    assert all(p.requires_grad for p in model.parameters())


def test_model_card_fields(model, guide):
    """Upstream's config (tests/test_upstream_conformance.py compares whole cards); no citation,
    as upstream's CachedGISTEmbedLoss has none."""
    loss = losses.CachedGISTEmbedLoss(model, guide, margin=0.1)
    config = loss.get_config_dict()
    assert config == upstream.CachedGISTEmbedLoss(model, guide, margin=0.1).get_config_dict()
    assert config["guide"] is guide and config["margin"] == 0.1 and config["mini_batch_size"] == 32
    assert not hasattr(loss, "citation")
    assert "solatorio2024gistembed" in losses.GISTEmbedLoss(model, guide).citation


@pytest.mark.parametrize("precomputed", [False, True], ids=["live-guide", "precomputed-guide"])
def test_stock_trainer_trains_matryoshka_cached_gist(model, guide, tmp_path, precomputed):
    dataset = pair_dataset(16, negatives=1)
    if precomputed:
        table = losses.GuideEmbeddings.from_dataset(model, guide, dataset, show_progress_bar=False)
        inner = losses.build_loss("cached_gist", model, guide_embeddings=table, mini_batch_size=4)
    else:
        inner = losses.build_loss("cached_gist", model, guide=guide, mini_batch_size=4)
    loss = losses.MatryoshkaLoss(model, inner, DIMS)
    before = [p.detach().clone() for p in model.parameters()]
    args = sentence_transformers.SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        per_device_train_batch_size=8,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
        seed=0,
    )
    trainer = sentence_transformers.SentenceTransformerTrainer(
        model=model, args=args, train_dataset=dataset, loss=loss
    )
    trainer.train()
    assert any(not torch.equal(old, new) for old, new in zip(before, model.parameters()))
    model.save(str(tmp_path / "saved"))
    card = (tmp_path / "saved" / "README.md").read_text()
    assert "MatryoshkaLoss" in card and "CachedGISTEmbedLoss" in card
    # Upstream's card: Matryoshka's citation; upstream's CachedGISTEmbedLoss has none to cite.
    assert "kusupati2024matryoshka" in card and "solatorio2024gistembed" not in card
