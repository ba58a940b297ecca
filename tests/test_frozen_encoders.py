"""Frozen encoders in training: the non-cached GIST guide and distillation teachers, live, offloaded or
precomputed and released, and the trainer's ``frozen_encoders`` option. Every mode trains identically."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from datasets import Dataset
from loss_checks import (
    assert_losses_agree,
    assert_same_grads,
    features_of,
    guide_from,
    loss_and_grads,
    pair_dataset,
    text_columns,
)
from tiny_models import SPECIAL_TOKENS, VOCAB, cross_encoder_from, save_tiny_bert, sentence_transformer_from

import st_ext
import st_ext.offload
from st_ext import losses
from st_ext._compat import MARGIN_MSE_TAKES_MANY_NEGATIVES, st_losses
from st_ext.losses.distillation import precompute_teacher_labels

upstream = st_losses()
BATCH = 8
DIMS = [32, 16, 8]
HAS_KL = hasattr(upstream, "DistillKLDivLoss")


def teacher_from(path, max_seq_length: int | None = None):
    teacher = sentence_transformer_from(path).eval()
    if max_seq_length is not None:
        teacher.max_seq_length = max_seq_length
    return teacher


# --------------------------------------------------------------------------------------------
# Non-cached GIST


@pytest.mark.parametrize("train", [False, True], ids=["eval", "dropout"])
@pytest.mark.parametrize("num_columns", [2, 3], ids=["pairs", "hard-negative"])
def test_gist_matches_upstream(model, guide, train, num_columns):
    columns = text_columns(BATCH, num_columns)
    ours, reference = losses.GISTEmbedLoss(model, guide), upstream.GISTEmbedLoss(model, guide)
    assert_losses_agree(model, ours, reference, columns, train=train)


def test_matryoshka_gist_matches_upstream(model, guide):
    columns = text_columns(BATCH, 2)
    ours = losses.MatryoshkaLoss(model, losses.GISTEmbedLoss(model, guide), DIMS, [1.0, 0.5, 0.25])
    reference = upstream.MatryoshkaLoss(model, upstream.GISTEmbedLoss(model, guide), DIMS, [1.0, 0.5, 0.25])
    assert_losses_agree(model, ours, reference, columns, train=False)


def test_gist_guide_modes_give_the_same_gradients(model, guide, guide_dir):
    columns = text_columns(BATCH, 3)
    resident = loss_and_grads(model, losses.GISTEmbedLoss(model, guide), columns, train=True)

    offloaded_guide = guide_from(guide_dir)
    offloaded = losses.GISTEmbedLoss(model, offloaded_guide, offload_guide=True)
    assert all(module is not offloaded_guide for module in offloaded.modules())
    assert not any(key.startswith("guide") for key in offloaded.state_dict())
    assert_same_grads(loss_and_grads(model, offloaded, columns, train=True), resident)

    table = losses.GuideEmbeddings.from_texts(model, guide, sum(columns, []), show_progress_bar=False)
    precomputed = losses.GISTEmbedLoss(model, guide_embeddings=table)
    assert_same_grads(loss_and_grads(model, precomputed, columns, train=True), resident)


def test_gist_offloaded_guide_runs_inside_on_device(model, guide, monkeypatch):
    placed = []
    real_on_device = st_ext.offload.on_device

    def recording_on_device(module, device, **kwargs):
        placed.append((module, torch.device(device)))
        return real_on_device(module, device, **kwargs)

    monkeypatch.setattr(st_ext.offload, "on_device", recording_on_device)
    loss = losses.GISTEmbedLoss(model, guide, offload_guide=True)
    loss(features_of(model, text_columns(BATCH, 2)), None)
    assert placed == [(guide, torch.device("cpu"))]


@pytest.mark.parametrize("make", ["gist", "cached_gist", "distillation"])
def test_offload_flag_moves_the_encoder_off_the_device(model, guide, monkeypatch, make):
    """A guide or teacher loaded on the accelerator goes to the CPU when the loss is told to offload it."""
    moved = []
    real_offload = st_ext.offload.offload

    def recording_offload(module, *args, **kwargs):
        moved.append(module)
        return real_offload(module, *args, **kwargs)

    monkeypatch.setattr(st_ext.offload, "offload", recording_offload)
    if make == "gist":
        losses.GISTEmbedLoss(model, guide, offload_guide=True)
    elif make == "cached_gist":
        losses.CachedGISTEmbedLoss(model, guide, offload_guide=True)
    else:
        losses.DistillationLoss(upstream.MSELoss(model), guide, offload_teacher=True)
    assert moved == [guide]


def test_precompute_extends_a_table_the_loss_already_has(model, guide):
    known = text_columns(4, 2, seed=3)
    table = losses.GuideEmbeddings.from_texts(model, guide, sum(known, []), show_progress_bar=False)
    table.values[0] = 7.0  # a row only the user's table has
    loss = losses.GISTEmbedLoss(model, guide, guide_embeddings=table)
    dataset = pair_dataset(6, seed=4)
    assert loss.precompute_frozen_encoder(dataset, show_progress_bar=False) is guide
    assert len(loss.guide_embeddings) == len(table) + 12
    assert torch.equal(loss.guide_embeddings.lookup(features_of(model, [known[0][:1]])[0])[0], torch.full((32,), 7.0))


def test_gist_without_guide_or_table_is_refused(model):
    with pytest.raises(TypeError, match="needs a guide model, or precomputed guide_embeddings"):
        losses.GISTEmbedLoss(model)
    with pytest.raises(ValueError, match="guided by the model itself"):
        losses.GISTEmbedLoss(model, model, offload_guide=True)
    with pytest.raises(ValueError, match="shares its parameters"):
        losses.GISTEmbedLoss(model, copy.copy(model), offload_guide=True)


# --------------------------------------------------------------------------------------------
# Distillation: labels from a teacher


def upstream_recipe_labels(teacher, kind: str, columns) -> torch.Tensor:
    """Labels as upstream's docstrings compute them: ``teacher.encode`` then ``similarity_pairwise``."""
    embeddings = [
        teacher.encode(column, convert_to_tensor=True, show_progress_bar=False).clone() for column in columns
    ]
    if kind == "embeddings":
        return embeddings[0]
    scores = torch.stack([teacher.similarity_pairwise(embeddings[0], other) for other in embeddings[1:]], dim=1)
    if kind == "scores":
        return scores
    margins = scores[:, :1] - scores[:, 1:]
    return margins.squeeze(1) if margins.shape[1] == 1 else margins


DISTILLATION_CASES = [
    pytest.param("MSELoss", "embeddings", 2, id="mse"),
    pytest.param("MarginMSELoss", "margins", 3, id="margin-mse"),
    pytest.param(
        "MarginMSELoss",
        "margins",
        4,
        id="margin-mse-2-negatives",
        marks=pytest.mark.skipif(not MARGIN_MSE_TAKES_MANY_NEGATIVES, reason="4.x's MarginMSELoss takes one negative"),
    ),
    pytest.param(
        "DistillKLDivLoss",
        "scores",
        3,
        id="kl-div",
        marks=pytest.mark.skipif(not HAS_KL, reason="no DistillKLDivLoss in this sentence-transformers"),
    ),
]


def with_labels(loss, labels):
    """``loss`` fed fixed labels, called like a loss that computes its own."""
    return lambda features, _labels: loss(features, labels)


@pytest.mark.parametrize("teacher_length", [None, 12], ids=["reads-model-ids", "retokenizes"])
@pytest.mark.parametrize("loss_name, kind, num_columns", DISTILLATION_CASES)
def test_teacher_labels_match_upstream_recipe_in_every_mode(
    model, guide_dir, loss_name, kind, num_columns, teacher_length
):
    columns = text_columns(BATCH, num_columns, min_words=6, max_words=20)
    inner = getattr(upstream, loss_name)(model)
    teacher = teacher_from(guide_dir, teacher_length)
    recipe_labels = upstream_recipe_labels(teacher, kind, columns)
    reference = loss_and_grads(model, with_labels(inner, recipe_labels), columns, train=True)

    live = losses.DistillationLoss(inner, teacher)
    assert_same_grads(loss_and_grads(model, live, columns, train=True), reference)

    offloaded_teacher = teacher_from(guide_dir, teacher_length)
    offloaded = losses.DistillationLoss(inner, offloaded_teacher, offload_teacher=True)
    assert all(module is not offloaded_teacher for module in offloaded.modules())
    assert_same_grads(loss_and_grads(model, offloaded, columns, train=True), reference)

    dataset = Dataset.from_dict({f"text_{i}": column for i, column in enumerate(columns)})
    table = losses.TeacherLabels.from_dataset(model, teacher, inner, dataset, batch_size=3, show_progress_bar=False)
    assert len(table) == BATCH
    precomputed = losses.DistillationLoss(inner, teacher_labels=table)
    assert_same_grads(loss_and_grads(model, precomputed, columns, train=True), reference)

    labelled = precompute_teacher_labels(teacher, dataset, inner, batch_size=3, show_progress_bar=False)
    assert "label" not in dataset.column_names
    column_labels = torch.tensor(labelled["label"])
    assert_same_grads(loss_and_grads(model, with_labels(inner, column_labels), columns, train=True), reference)


def test_cross_encoder_teacher_margins(model, tiny_classifier_dir):
    teacher = cross_encoder_from(tiny_classifier_dir)
    columns = text_columns(BATCH, 3)
    inner = upstream.MarginMSELoss(model)
    scores = [
        torch.as_tensor(teacher.predict(list(zip(columns[0], other)), convert_to_tensor=True, show_progress_bar=False))
        for other in columns[1:]
    ]
    margins = (scores[0] - scores[1]).float()
    reference = loss_and_grads(model, with_labels(inner, margins), columns, train=False)
    assert_same_grads(loss_and_grads(model, losses.DistillationLoss(inner, teacher), columns, train=False), reference)
    assert_same_grads(
        loss_and_grads(model, losses.DistillationLoss(inner, teacher, offload_teacher=True), columns, train=False),
        reference,
    )


def test_precompute_releases_the_teacher(model, guide_dir):
    teacher = teacher_from(guide_dir)
    loss = losses.DistillationLoss(upstream.MarginMSELoss(model), teacher)
    dataset = pair_dataset(6, negatives=1)
    assert loss.precompute_frozen_encoder(dataset, show_progress_bar=False) is teacher
    report = st_ext.offload.release(teacher, holders=[loss])
    assert report.ok, report
    assert loss.teacher is None and st_ext.offload.is_released(teacher)
    with pytest.raises(st_ext.offload.ReleasedModuleError, match="released"):
        teacher.encode(["the cat"])
    loss(features_of(model, [dataset["anchor"], dataset["positive"], dataset["negative_1"]]), None).backward()
    unknown = text_columns(2, 3, seed=9)
    with pytest.raises(KeyError, match="not in the precomputed teacher labels"):
        loss(features_of(model, unknown), None)


@pytest.mark.skipif(MARGIN_MSE_TAKES_MANY_NEGATIVES, reason="this MarginMSELoss takes several negatives")
def test_one_negative_only_on_4x(model, guide_dir):
    loss = losses.DistillationLoss(upstream.MarginMSELoss(model), teacher_from(guide_dir))
    with pytest.raises(ValueError, match="takes \\(query, positive, negative\\) columns; got 4"):
        loss(features_of(model, text_columns(BATCH, 4)), None)
    dataset = pair_dataset(4, negatives=2)
    with pytest.raises(ValueError, match="takes \\(query, positive, negative\\) columns; got 4"):
        precompute_teacher_labels(
            teacher_from(guide_dir), dataset, upstream.MarginMSELoss(model), show_progress_bar=False
        )


def test_precompute_teacher_labels_freezes_and_releases_a_fresh_teacher(model, guide_dir):
    teacher = sentence_transformer_from(guide_dir)
    assert all(p.requires_grad for p in teacher.parameters())
    dataset = pair_dataset(4, negatives=1)
    labelled = precompute_teacher_labels(
        teacher, dataset, upstream.MarginMSELoss(model), release_teacher=True, show_progress_bar=False
    )
    assert len(labelled["label"]) == 4 and st_ext.offload.is_released(teacher)


def test_multi_label_cross_encoder_teacher_is_refused(model, tmp_path):
    from tiny_models import save_tiny_bert

    path = save_tiny_bert(tmp_path / "two_labels", classifier=True, num_labels=2)
    teacher = st_ext.CrossEncoder(str(path), num_labels=2, max_length=32, device="cpu")
    with pytest.raises(ValueError, match="one score per pair; this one has num_labels=2"):
        losses.DistillationLoss(upstream.MarginMSELoss(model), teacher)


def test_distillation_bad_input(model, guide_dir, tiny_classifier_dir):
    teacher = teacher_from(guide_dir)
    with pytest.raises(TypeError, match="DistillationLoss supports"):
        losses.DistillationLoss(upstream.MultipleNegativesRankingLoss(model), teacher)
    with pytest.raises(ValueError, match="needs a teacher model, or precomputed teacher_labels"):
        losses.DistillationLoss(upstream.MSELoss(model))
    with pytest.raises(TypeError, match="a CrossEncoder teacher has none"):
        losses.DistillationLoss(upstream.MSELoss(model), cross_encoder_from(tiny_classifier_dir))
    with pytest.raises(ValueError, match="shares parameters with the student"):
        losses.DistillationLoss(upstream.MSELoss(model), model)
    loss = losses.DistillationLoss(upstream.MarginMSELoss(model), teacher)
    columns = text_columns(BATCH, 3)
    with pytest.raises(ValueError, match="has labels from the dataset"):
        loss(features_of(model, columns), torch.zeros(BATCH))
    with pytest.raises(ValueError, match="need \\(query, candidate_1, ...\\) columns"):
        loss(features_of(model, columns[:1]), None)
    dataset = pair_dataset(4, negatives=1).add_column("label", [0.0] * 4)
    with pytest.raises(ValueError, match="already has a 'label' column"):
        precompute_teacher_labels(teacher, dataset, upstream.MarginMSELoss(model), show_progress_bar=False)


# --------------------------------------------------------------------------------------------
# Every way to precompute embeds what the live encoder sees

#: Shorter than many of the test texts: the live encoder sees them truncated.
MODEL_LENGTH = 16
FROZEN_ENCODER_KINDS = ["reads-model-ids", "shorter-limit", "other-vocabulary"]


@pytest.fixture(scope="module")
def other_vocabulary_dir(tmp_path_factory):
    """A tiny BERT whose tokenizer numbers the words in another order: an encoder that re-tokenizes."""
    words = [token for token in VOCAB if token not in SPECIAL_TOKENS]
    return save_tiny_bert(tmp_path_factory.mktemp("other_vocabulary"), seed=2, tokens=SPECIAL_TOKENS + words[::-1])


def frozen_encoder(kind, guide_dir, other_vocabulary_dir, tiny_classifier_dir):
    """A frozen encoder that reads the model's token ids, or one that re-tokenizes the decoded rows."""
    if kind == "cross-encoder":
        return cross_encoder_from(tiny_classifier_dir)
    if kind == "shorter-limit":
        return guide_from(guide_dir, max_seq_length=MODEL_LENGTH - 4)
    return guide_from(other_vocabulary_dir if kind == "other-vocabulary" else guide_dir)


def raw_and_kept_differ(num_columns: int) -> list[list[str]]:
    """Row-aligned columns whose raw strings differ from what the model's tokenizer keeps of them: most are
    longer than ``MODEL_LENGTH`` tokens, and every other row starts with a word outside the vocabulary."""
    columns = text_columns(6, num_columns, seed=5, min_words=4, max_words=30)
    return [[f"Zebra {text}" if row % 2 else text for row, text in enumerate(column)] for column in columns]


@pytest.mark.parametrize("entry_point", ["from_texts", "from_dataset", "precompute_frozen_encoder"])
@pytest.mark.parametrize("encoder_kind", FROZEN_ENCODER_KINDS)
def test_precomputed_guide_rows_equal_the_live_guide(
    model, guide_dir, other_vocabulary_dir, encoder_kind, entry_point
):
    model.max_seq_length = MODEL_LENGTH
    guide = frozen_encoder(encoder_kind, guide_dir, other_vocabulary_dir, None)
    columns = raw_and_kept_differ(2)
    dataset = Dataset.from_dict({"anchor": columns[0], "positive": columns[1]})
    if entry_point == "from_texts":
        table = losses.GuideEmbeddings.from_texts(
            model, guide, sum(columns, []), batch_size=4, show_progress_bar=False
        )
    elif entry_point == "from_dataset":
        table = losses.GuideEmbeddings.from_dataset(model, guide, dataset, batch_size=4, show_progress_bar=False)
    else:
        holder = losses.GISTEmbedLoss(model, guide)
        holder.precompute_frozen_encoder(dataset, batch_size=4, show_progress_bar=False)
        table = holder.guide_embeddings
    features, ranges = features_of(model, columns), [[(0, len(column))] for column in columns]
    live = losses.GISTEmbedLoss(model, guide).frozen_embeddings(features, ranges)
    precomputed = losses.GISTEmbedLoss(model, guide_embeddings=table).frozen_embeddings(features, ranges)
    raw = torch.as_tensor(guide.encode(columns[0], show_progress_bar=False))
    assert not torch.allclose(raw, torch.cat(live[0]), atol=1e-3), "the premise: raw strings embed differently"
    for precomputed_column, live_column in zip(precomputed, live):
        torch.testing.assert_close(torch.cat(precomputed_column), torch.cat(live_column), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "entry_point", ["TeacherLabels.from_dataset", "precompute_teacher_labels", "precompute_frozen_encoder"]
)
@pytest.mark.parametrize(
    "encoder_kind, loss_name",
    [(kind, "MSELoss") for kind in FROZEN_ENCODER_KINDS]
    + [(kind, "MarginMSELoss") for kind in [*FROZEN_ENCODER_KINDS, "cross-encoder"]],
)
def test_precomputed_teacher_labels_equal_the_live_teacher(
    model, guide_dir, other_vocabulary_dir, tiny_classifier_dir, encoder_kind, loss_name, entry_point
):
    model.max_seq_length = MODEL_LENGTH
    teacher = frozen_encoder(encoder_kind, guide_dir, other_vocabulary_dir, tiny_classifier_dir)
    inner = getattr(upstream, loss_name)(model)
    columns = raw_and_kept_differ(3 if loss_name == "MarginMSELoss" else 1)
    dataset = Dataset.from_dict({f"text_{i}": column for i, column in enumerate(columns)})
    features = features_of(model, columns)
    live = losses.DistillationLoss(inner, teacher).teacher_outputs(features)
    if entry_point == "TeacherLabels.from_dataset":
        table = losses.TeacherLabels.from_dataset(
            model, teacher, inner, dataset, batch_size=4, show_progress_bar=False
        )
        precomputed = losses.DistillationLoss(inner, teacher_labels=table).teacher_outputs(features)
    elif entry_point == "precompute_teacher_labels":
        labelled = precompute_teacher_labels(teacher, dataset, inner, batch_size=4, show_progress_bar=False)
        precomputed = torch.tensor(labelled["label"], dtype=torch.float32)
    else:
        holder = losses.DistillationLoss(inner, teacher)
        holder.precompute_frozen_encoder(dataset, batch_size=4, show_progress_bar=False)
        precomputed = holder.teacher_outputs(features)
    torch.testing.assert_close(precomputed, live, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------
# The trainer's option


def train_two_steps(model_dir, make_loss, dataset, tmp_path, prompts=None, **trainer_kwargs):
    """Weights after two steps from a fixed seed, and the trainer."""
    import sentence_transformers

    model = sentence_transformer_from(model_dir)
    args = sentence_transformers.SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        per_device_train_batch_size=4,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        prompts=prompts,
    )
    trainer = st_ext.SentenceTransformerTrainer(
        model=model, args=args, train_dataset=dataset, loss=make_loss(model), **trainer_kwargs
    )
    trainer.train()
    return [p.detach().clone() for p in model.parameters()], trainer


def gist_loss_factory(guide_dir, holder: list):
    def make(model):
        guide = guide_from(guide_dir)
        holder.append(guide)
        cached = losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=2)
        return {"matryoshka": losses.MatryoshkaLoss(model, cached, DIMS), "plain": losses.GISTEmbedLoss(model, guide)}

    return make


def two_datasets():
    return {"matryoshka": pair_dataset(8, seed=1, negatives=1), "plain": pair_dataset(8, seed=2)}


@pytest.mark.parametrize("mode", ["offload", "precompute"])
def test_trainer_option_trains_as_resident_gist(tiny_bert_dir, guide_dir, tmp_path, mode):
    resident, _ = train_two_steps(tiny_bert_dir, gist_loss_factory(guide_dir, []), two_datasets(), tmp_path / "r")
    guides: list = []
    weights, trainer = train_two_steps(
        tiny_bert_dir, gist_loss_factory(guide_dir, guides), two_datasets(), tmp_path / "m", frozen_encoders=mode
    )
    for old, new in zip(resident, weights):
        torch.testing.assert_close(new, old, rtol=1e-5, atol=1e-6)
    guide = guides[0]
    inner = trainer.loss["matryoshka"].loss
    if mode == "offload":
        assert inner.offload_guide and {p.device.type for p in guide.parameters()} == {"cpu"}
        assert all(module is not guide for module in trainer.loss["matryoshka"].modules())
    else:
        assert inner.guide is None and trainer.loss["plain"].guide is None
        assert st_ext.offload.is_released(guide)
        assert [report.ok for report in trainer.frozen_encoder_reports] == [True]


def test_trainer_option_trains_as_resident_teacher(tiny_bert_dir, guide_dir, tmp_path):
    def make(model):
        return losses.DistillationLoss(upstream.MarginMSELoss(model), teacher_from(guide_dir))

    dataset = pair_dataset(8, negatives=1)
    resident, _ = train_two_steps(tiny_bert_dir, make, dataset, tmp_path / "r")
    for mode in ("offload", "precompute"):
        weights, trainer = train_two_steps(tiny_bert_dir, make, dataset, tmp_path / mode, frozen_encoders=mode)
        for old, new in zip(resident, weights):
            torch.testing.assert_close(new, old, rtol=1e-5, atol=1e-6)
    assert trainer.loss.teacher is None and len(trainer.loss.teacher_labels) == 8
    assert [report.ok for report in trainer.frozen_encoder_reports] == [True]
    trainer.model.save(str(tmp_path / "saved"))
    card = (tmp_path / "saved" / "README.md").read_text()
    assert "DistillationLoss" in card and "MarginMSELoss" in card and "hofstätter2021improving" in card


def test_trainer_precompute_routes_each_loss_its_own_datasets(tiny_bert_dir, guide_dir, tmp_path):
    """A teacher labels the (query, positive, negative) rows routed to its loss, evaluation rows included,
    not the pairs of another loss in the dict."""
    teachers: list = []

    def make(model):
        teachers.append(teacher_from(guide_dir))
        distil = losses.DistillationLoss(upstream.MarginMSELoss(model), teachers[0])
        return {"distil": distil, "pairs": upstream.MultipleNegativesRankingLoss(model)}

    train = {"distil": pair_dataset(8, seed=1, negatives=1), "pairs": pair_dataset(8, seed=2)}
    evaluation = {"distil": pair_dataset(4, seed=3, negatives=1), "pairs": pair_dataset(4, seed=4)}
    _, trainer = train_two_steps(
        tiny_bert_dir, make, train, tmp_path, eval_dataset=evaluation, frozen_encoders="precompute"
    )
    assert len(trainer.loss["distil"].teacher_labels) == 8 + 4
    assert st_ext.offload.is_released(teachers[0])


def test_trainer_option_bad_input(tiny_bert_dir, guide_dir, tmp_path):
    dataset = pair_dataset(8)

    def ours(model):
        return losses.GISTEmbedLoss(model, guide_from(guide_dir))

    def theirs(model):
        return upstream.GISTEmbedLoss(model, guide_from(guide_dir))

    with pytest.raises(ValueError, match="frozen_encoders must be one of"):
        train_two_steps(tiny_bert_dir, ours, dataset, tmp_path, frozen_encoders="sideways")
    with pytest.raises(TypeError, match="Use st_ext's class of the same name"):
        train_two_steps(tiny_bert_dir, theirs, dataset, tmp_path, frozen_encoders="offload")
    with pytest.raises(ValueError, match="the trainer adds prompts"):
        train_two_steps(tiny_bert_dir, ours, dataset, tmp_path, frozen_encoders="precompute", prompts="query: ")
    with pytest.raises(ValueError, match="holds no frozen encoder"):
        train_two_steps(
            tiny_bert_dir, upstream.MultipleNegativesRankingLoss, dataset, tmp_path, frozen_encoders="precompute"
        )


# --------------------------------------------------------------------------------------------
# CUDA


@pytest.mark.cuda
def test_offloaded_guide_and_teacher_stay_on_cpu_and_train_as_resident(tiny_bert_dir, guide_dir):
    def step(loss, model, columns):
        features = [
            {k: v.to("cuda") if torch.is_tensor(v) else v for k, v in f.items()} for f in features_of(model, columns)
        ]
        torch.manual_seed(0)
        loss(features, None).backward()
        grads = [p.grad.detach().cpu() for p in model.parameters() if p.grad is not None]  # none kept on CUDA
        model.zero_grad(set_to_none=True)
        return grads

    model = sentence_transformer_from(tiny_bert_dir).to("cuda").eval()
    columns = text_columns(BATCH, 3)
    for make in (
        lambda frozen, offload: losses.GISTEmbedLoss(model, frozen, offload_guide=offload),
        lambda frozen, offload: losses.DistillationLoss(
            upstream.MarginMSELoss(model), frozen, offload_teacher=offload
        ),
    ):
        resident = step(make(guide_from(guide_dir).to("cuda"), False), model, columns)
        frozen = guide_from(guide_dir).to("cuda")  # loaded on the accelerator, as SentenceTransformer does by default
        offloaded = make(frozen, True).to("cuda")
        gc.collect()  # the resident guide and loss sit in reference cycles
        before = torch.cuda.memory_allocated()
        offloaded_grads = step(offloaded, model, columns)
        gc.collect()
        assert {p.device.type for p in frozen.parameters()} == {"cpu"}
        assert torch.cuda.memory_allocated() == before
        for old, new in zip(resident, offloaded_grads):
            torch.testing.assert_close(new, old)
