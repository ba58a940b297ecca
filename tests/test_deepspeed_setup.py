"""Constructing an st_ext trainer with the Trainer's ``deepspeed`` argument: what cannot train or save is
refused then, in one line that says what works (see :mod:`st_ext.training.deepspeed`); what can,
constructs. The training itself runs on two ranks in ``tests/test_distributed.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from datasets import Dataset
from packaging.version import Version
from tiny_models import save_tiny_bert, sentence_transformer_from

from st_ext import SentenceTransformerTrainer, SentenceTransformerTrainingArguments, losses
from st_ext._compat import st_losses
from st_ext.training import deepspeed as deepspeed_setup

pytest.importorskip("deepspeed", reason="DeepSpeed is a test extra (requirements/test.txt)")

GATHER_ON_SAVE = "stage3_gather_16bit_weights_on_model_save"


@pytest.fixture(autouse=True)
def deepspeed_state_released():
    """What a DeepSpeed trainer leaves in the process is put back after each test: transformers keeps the
    config globally (a ZeRO-3 one makes every later from_pretrained partition its model), accelerate
    keeps its state, and exports ACCELERATE_USE_DEEPSPEED and friends, which later trainers would obey."""
    environment = dict(os.environ)
    os.environ["DS_ACCELERATOR"] = "cpu"
    yield
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ.clear()
    os.environ.update(environment)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return sentence_transformer_from(save_tiny_bert(tmp_path_factory.mktemp("ds_setup") / "model", dropout=0.0))


def zero_config(stage: int, **zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": stage, **zero},
        "zero_allow_untested_optimizer": True,
    }


def build_trainer(model, loss, config: dict | str, tmp_path, **settings):
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path), deepspeed=config, report_to="none", max_steps=1, **settings
    )
    dataset = Dataset.from_dict({"anchor": ["a b", "c d"], "positive": ["a", "c"]})
    return SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset, loss=loss)


def cached_matryoshka(model):
    return losses.MatryoshkaLoss(model, losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2), [32, 16])


@pytest.mark.parametrize("stage", [1, 2])
def test_st_ext_cached_losses_construct_under_zero(stage, model, tmp_path):
    trainer = build_trainer(model, cached_matryoshka(model), zero_config(stage), tmp_path)
    assert trainer.args.hf_deepspeed_config.get_value("zero_optimization.stage") == stage


def test_zero3_without_gathering_on_save_is_refused(model, tmp_path):
    """Upstream fails only when it saves, after training, on every rank but the first."""
    with pytest.raises(ValueError, match=GATHER_ON_SAVE) as error:
        build_trainer(model, cached_matryoshka(model), zero_config(3), tmp_path)
    assert "\n" not in str(error.value)
    trainer = build_trainer(model, cached_matryoshka(model), zero_config(3, **{GATHER_ON_SAVE: True}), tmp_path)
    assert trainer.args.hf_deepspeed_config.is_zero3()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_upstream_cached_loss_constructs_on_st_exts_engine(stage, model, tmp_path):
    """The trainer forwards upstream's own loss object on st_ext's engine (tests/test_upstream_forwards.py)."""
    upstream = st_losses().CachedMultipleNegativesRankingLoss(model, mini_batch_size=2)
    zero = {GATHER_ON_SAVE: True} if stage == 3 else {}
    trainer = build_trainer(model, upstream, zero_config(stage, **zero), tmp_path)
    assert trainer.engine_forwards[id(upstream)].loss is upstream


def test_upstream_cached_loss_inside_upstreams_wrapper_is_refused_naming_st_exts(model, tmp_path):
    """Inside upstream's MatryoshkaLoss the cached loss is the wrapper's to run, on upstream's engine."""
    inner = st_losses().CachedMultipleNegativesRankingLoss(model, mini_batch_size=2)
    wrapped = st_losses().MatryoshkaLoss(model, inner, [32, 16])
    with pytest.raises(ValueError, match=r"use st_ext\.losses\.(MatryoshkaLoss|CachedMultipleNegativesRankingLoss)\."):
        build_trainer(model, wrapped, zero_config(1), tmp_path)


def test_cross_encoder_cached_loss_under_deepspeed(tmp_path):
    """Constructs where st_ext's engine forwards it (sentence-transformers 6); refused in one line before."""
    from archetype_losses import CASES, case_dataset, case_loss, case_model, save_case_models

    from st_ext import CrossEncoderTrainer, CrossEncoderTrainingArguments

    model = case_model("cross_encoder_cmnrl", save_case_models(tmp_path / "models"))
    loss = case_loss("cross_encoder_cmnrl", model)
    args = CrossEncoderTrainingArguments(
        output_dir=str(tmp_path), deepspeed=zero_config(2), report_to="none", max_steps=1
    )

    def build():
        return CrossEncoderTrainer(
            model=model, args=args, train_dataset=case_dataset("cross_encoder_cmnrl"), loss=loss
        )

    if CASES["cross_encoder_cmnrl"].missing() is None:
        assert build().engine_forwards[id(loss)].loss is loss
        return
    with pytest.raises(ValueError, match="from sentence-transformers 6 on for a CrossEncoder") as error:
        build()
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("stage, overlap_comm", [(2, False), (3, False), (1, True)])
def test_deepspeed_before_0_17_refuses_stages_that_reduce_from_hooks(
    stage, overlap_comm, model, tmp_path, monkeypatch
):
    monkeypatch.setattr(deepspeed_setup, "deepspeed_version", lambda: Version("0.16.9"))
    config = zero_config(stage, overlap_comm=overlap_comm, **({GATHER_ON_SAVE: True} if stage == 3 else {}))
    with pytest.raises(ValueError, match=r"need deepspeed>=0\.17\.0 \(installed: 0\.16\.9\).*ZeRO stage 1 without"):
        build_trainer(model, cached_matryoshka(model), config, tmp_path)


def test_deepspeed_before_0_17_accepts_stage_1_without_overlap(model, tmp_path, monkeypatch):
    monkeypatch.setattr(deepspeed_setup, "deepspeed_version", lambda: Version("0.16.9"))
    build_trainer(model, cached_matryoshka(model), zero_config(1, overlap_comm=False), tmp_path)


def test_plain_losses_are_not_checked_for_the_version(model, tmp_path, monkeypatch):
    monkeypatch.setattr(deepspeed_setup, "deepspeed_version", lambda: Version("0.16.9"))
    build_trainer(model, losses.MultipleNegativesRankingLoss(model), zero_config(2), tmp_path)


def test_use_cpu_with_deepspeed_warns_that_the_config_is_ignored(model, tmp_path):
    with pytest.warns(UserWarning, match="accelerate trains with DDP and ignores the config"):
        trainer = build_trainer(model, cached_matryoshka(model), zero_config(2), tmp_path, use_cpu=True)
    assert str(trainer.accelerator.distributed_type) != "DistributedType.DEEPSPEED"


@pytest.mark.parametrize("name", ["deepspeed_zero2.json", "deepspeed_zero3.json"])
def test_example_configs_construct_with_cached_losses(name, model, tmp_path):
    """The README's configs, given as a path the way a script passes them."""
    config = str(Path(__file__).resolve().parent.parent / "examples" / name)
    trainer = build_trainer(model, cached_matryoshka(model), config, tmp_path)
    assert trainer.args.hf_deepspeed_config.get_value("zero_optimization.stage") in (2, 3)
