"""Trainers: gradient_checkpointing=True trains every model kind, and saved models load upstream."""

from __future__ import annotations

import pytest
import sentence_transformers
from datasets import Dataset
from tiny_models import SENTENCES, cross_encoder_from, sentence_transformer_from
from transformers import TrainerCallback

import st_ext
from st_ext import checkpointing, losses
from st_ext._compat import CROSS_ENCODER_HAS_CHECKPOINTING, st_losses


class RecordCheckpointing(TrainerCallback):
    """Records, at every optimizer step, whether the model's layers checkpoint and with which kwargs."""

    def __init__(self, model):
        self.model = model
        self.steps: list[tuple[bool, bool | None]] = []

    def on_step_end(self, args, state, control, **kwargs):
        reentrant = None
        for module in self.model.modules():
            if getattr(module, "gradient_checkpointing", False) is True:
                reentrant = module._gradient_checkpointing_func.keywords.get("use_reentrant")
                break
        self.steps.append((checkpointing.is_enabled(self.model), reentrant))


def pair_dataset() -> Dataset:
    return Dataset.from_dict({"anchor": SENTENCES, "positive": SENTENCES[1:] + SENTENCES[:1]})


def scored_pair_dataset() -> Dataset:
    return Dataset.from_dict(
        {"query": SENTENCES, "passage": SENTENCES[::-1], "label": [float(i % 2) for i in range(len(SENTENCES))]}
    )


def training_args(args_class, output_dir, **overrides):
    settings = dict(
        output_dir=str(output_dir),
        max_steps=2,
        per_device_train_batch_size=4,
        gradient_checkpointing=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
        seed=0,
    )
    settings.update(overrides)
    return args_class(**settings)


def train_cross_encoder(trainer_class, model, tmp_path, **overrides):
    from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss

    recorder = RecordCheckpointing(model)
    trainer = trainer_class(
        model=model,
        args=training_args(st_ext.CrossEncoderTrainingArguments, tmp_path / "out", **overrides),
        train_dataset=scored_pair_dataset(),
        loss=BinaryCrossEntropyLoss(model),
        callbacks=[recorder],
    )
    trainer.train()
    return recorder


@pytest.mark.skipif(CROSS_ENCODER_HAS_CHECKPOINTING, reason="upstream CrossEncoder has the method from 5.0.0 on")
def test_upstream_trainer_fails_on_plain_cross_encoder(tiny_classifier_dir, tmp_path):
    model = cross_encoder_from(tiny_classifier_dir, model_class=sentence_transformers.CrossEncoder)
    with pytest.raises(AttributeError, match="gradient_checkpointing_enable"):
        train_cross_encoder(sentence_transformers.CrossEncoderTrainer, model, tmp_path)


def test_st_ext_trainer_trains_a_plain_upstream_cross_encoder(tiny_classifier_dir, tmp_path):
    model = cross_encoder_from(tiny_classifier_dir, model_class=sentence_transformers.CrossEncoder)
    recorder = train_cross_encoder(st_ext.CrossEncoderTrainer, model, tmp_path)
    assert recorder.steps == [(True, False), (True, False)]
    # The lent methods are taken back: the user's object has no new attributes.
    assert "gradient_checkpointing_enable" not in vars(model)
    assert type(model) is sentence_transformers.CrossEncoder


def test_cross_encoder_trains_saves_and_loads_upstream(tiny_classifier_dir, tmp_path):
    model = cross_encoder_from(tiny_classifier_dir)
    before = model.predict([(SENTENCES[0], SENTENCES[1])])
    recorder = train_cross_encoder(
        st_ext.CrossEncoderTrainer, model, tmp_path, gradient_checkpointing_kwargs={"use_reentrant": True}
    )
    assert recorder.steps == [(True, True), (True, True)]
    model.save_pretrained(str(tmp_path / "saved"))
    loaded = sentence_transformers.CrossEncoder(str(tmp_path / "saved"), device="cpu")
    model.eval()
    after = model.predict([(SENTENCES[0], SENTENCES[1])])
    assert after != pytest.approx(before)
    assert loaded.predict([(SENTENCES[0], SENTENCES[1])]) == pytest.approx(after, rel=1e-5)


@pytest.mark.parametrize("model_class", [st_ext.SentenceTransformer, sentence_transformers.SentenceTransformer])
def test_sentence_transformer_trains_saves_and_loads_upstream(tiny_bert_dir, tmp_path, model_class):
    model = sentence_transformer_from(tiny_bert_dir, model_class=model_class)
    recorder = RecordCheckpointing(model)
    trainer = st_ext.SentenceTransformerTrainer(
        model=model,
        args=training_args(st_ext.SentenceTransformerTrainingArguments, tmp_path / "out"),
        train_dataset=pair_dataset(),
        loss=st_losses().MultipleNegativesRankingLoss(model),
        callbacks=[recorder],
    )
    trainer.train()
    assert recorder.steps == [(True, False), (True, False)]
    model.save(str(tmp_path / "saved"))
    loaded = sentence_transformers.SentenceTransformer(str(tmp_path / "saved"), device="cpu")
    assert type(loaded) is sentence_transformers.SentenceTransformer
    model.eval()
    assert loaded.encode(SENTENCES[:2]) == pytest.approx(model.encode(SENTENCES[:2]), rel=1e-4, abs=1e-5)


def test_upstream_model_directory_loads_in_st_ext(tiny_bert_dir, tmp_path):
    upstream = sentence_transformer_from(tiny_bert_dir, model_class=sentence_transformers.SentenceTransformer)
    upstream.save(str(tmp_path / "upstream"))
    model = st_ext.SentenceTransformer(str(tmp_path / "upstream"), device="cpu")
    assert model.encode(SENTENCES[:2]) == pytest.approx(upstream.encode(SENTENCES[:2]), rel=1e-4, abs=1e-5)
    model.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing


def test_loss_by_registered_name(tiny_bert_dir, tmp_path):
    model = sentence_transformer_from(tiny_bert_dir)
    trainer = st_ext.SentenceTransformerTrainer(
        model=model,
        args=training_args(
            st_ext.SentenceTransformerTrainingArguments, tmp_path / "out", gradient_checkpointing=False
        ),
        train_dataset=pair_dataset(),
        loss="cached_mnrl",
    )
    assert type(trainer.loss).__name__ == "CachedMultipleNegativesRankingLoss"
    trainer.train()
    with pytest.raises(ValueError, match="Unknown loss 'mnlr'"):
        st_ext.SentenceTransformerTrainer(model=model, args=trainer.args, train_dataset=pair_dataset(), loss="mnlr")


def test_the_size_auto_chose_is_logged_with_the_run_once_per_choice(tiny_bert_dir, tmp_path):
    """A Trainer user sees the chosen mini-batch size where the run's other numbers are (its log history,
    the console, the reporting integrations), and once per choice rather than at every step."""
    model = sentence_transformer_from(tiny_bert_dir)
    inner = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size="auto", memory_budget_mb=4096)
    args = training_args(
        st_ext.SentenceTransformerTrainingArguments, tmp_path / "out", gradient_checkpointing=False, max_steps=3
    )
    loss = losses.MatryoshkaLoss(model, inner, [32, 16])
    trainer = st_ext.SentenceTransformerTrainer(model=model, args=args, train_dataset=pair_dataset(), loss=loss)
    trainer.train()
    logged = [entry["mini_batch_size"] for entry in trainer.state.log_history if "mini_batch_size" in entry]
    assert logged == [inner.auto_mini_batch.choice.size]
