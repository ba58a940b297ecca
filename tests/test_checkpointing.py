"""Checkpointing switches on SentenceTransformer, CrossEncoder and arbitrary module trees."""

from __future__ import annotations

import logging

import pytest
import sentence_transformers
import torch
from tiny_models import SENTENCES, cross_encoder_from, sentence_transformer_from
from torch import nn

from st_ext import CrossEncoder, SentenceTransformer, _compat, checkpointing
from st_ext._compat import preprocess, st_modules
from st_ext.checkpointing import CheckpointingNotSupportedError
from st_ext.memory import measure_peak


def embedding_grads(model: SentenceTransformer, texts=SENTENCES, seed: int = 0) -> dict[str, torch.Tensor]:
    """Gradients of a fixed function of the embeddings, with dropout active and a fixed RNG seed."""
    model.train()
    model.zero_grad(set_to_none=True)
    features = preprocess(model, texts)
    torch.manual_seed(seed)
    embeddings = model(features)["sentence_embedding"]
    (embeddings.pow(2).sum() + embeddings[:, 0].sum()).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def score_grads(model: CrossEncoder, seed: int = 0) -> dict[str, torch.Tensor]:
    """Gradients of the CrossEncoder's logits on fixed pairs, dropout active, fixed RNG seed."""
    model.train()
    model.zero_grad(set_to_none=True)
    pairs = list(zip(SENTENCES[::2], SENTENCES[1::2]))
    tokenizer = model.tokenizer
    inputs = tokenizer([a for a, _ in pairs], [b for _, b in pairs], padding=True, return_tensors="pt")
    torch.manual_seed(seed)
    classifier = checkpointing.checkpointable_modules(model)[0][1]
    logits = classifier(**inputs).logits
    logits.square().sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(expected: dict, actual: dict) -> None:
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def layer_checkpoint_kwargs(model: nn.Module) -> dict:
    """The keyword arguments bound into the checkpoint function of the first checkpointing layer."""
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) is True:
            return dict(module._gradient_checkpointing_func.keywords)
    raise AssertionError("no layer checkpoints")


def test_sentence_transformer_gradients_match_without_checkpointing(tiny_bert_dir):
    model = sentence_transformer_from(tiny_bert_dir)
    reference = embedding_grads(model)
    model.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing
    assert_same_grads(reference, embedding_grads(model))
    # Dropout is really on: another seed gives other gradients, so the equality above is not vacuous.
    with pytest.raises(AssertionError):
        assert_same_grads(reference, embedding_grads(model, seed=1))


def test_cross_encoder_gradients_match_without_checkpointing(tiny_classifier_dir):
    model = cross_encoder_from(tiny_classifier_dir)
    reference = score_grads(model)
    model.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing
    assert_same_grads(reference, score_grads(model))


def test_cross_encoder_reaches_its_classifier(tiny_classifier_dir):
    model = cross_encoder_from(tiny_classifier_dir)
    [(name, classifier)] = checkpointing.checkpointable_modules(model)
    assert classifier.config.model_type == "bert"
    model.activation_checkpointing_enable()
    assert model.is_activation_checkpointing and model.is_gradient_checkpointing
    model.activation_checkpointing_disable()
    assert not model.is_gradient_checkpointing


def test_default_is_non_reentrant_and_caller_choice_is_kept(tiny_bert_dir):
    model = sentence_transformer_from(tiny_bert_dir)
    model.gradient_checkpointing_enable()
    assert layer_checkpoint_kwargs(model)["use_reentrant"] is False
    model.gradient_checkpointing_disable()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert layer_checkpoint_kwargs(model)["use_reentrant"] is True


def test_every_route_of_an_asymmetric_model(tiny_bert_dir):
    modules = st_modules()
    query = modules.Transformer(str(tiny_bert_dir), max_seq_length=32)
    document = modules.Transformer(str(tiny_bert_dir), max_seq_length=32)
    router = modules.Asym({"query": [query], "doc": [document]})
    pooling = modules.Pooling(query.get_word_embedding_dimension())
    model = SentenceTransformer(modules=[router, pooling], device="cpu")
    names = checkpointing.enable(model)
    assert len(names) == 2
    for transformer in (query, document):
        assert checkpointing.is_enabled(transformer)
    checkpointing.disable(model)
    assert not any(checkpointing.is_enabled(t) for t in (query, document))


@pytest.mark.parametrize("model_class", [SentenceTransformer, sentence_transformers.SentenceTransformer])
def test_nested_model_inside_a_plain_container(tiny_bert_dir, model_class):
    """A sentence-transformers model inside a container is walked through, not asked to switch itself:
    upstream's own method has no disable (and uses transformers' deprecated names on 6.x)."""
    inner = sentence_transformer_from(tiny_bert_dir, model_class=model_class)
    container = nn.ModuleDict({"encoder": inner, "head": nn.Linear(32, 2)})
    [name] = checkpointing.enable(container)
    assert name.startswith("encoder.0.") and _compat.is_hf_model(container.get_submodule(name))
    assert checkpointing.is_enabled(inner)
    assert checkpointing.disable(container) == [name]
    assert not checkpointing.is_enabled(inner)


class NoArgumentCheckpointing(nn.Module):
    """A custom module following the old convention: enable() takes no arguments."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.gradient_checkpointing = False

    def gradient_checkpointing_enable(self):
        self.gradient_checkpointing = True

    def gradient_checkpointing_disable(self):
        self.gradient_checkpointing = False


def test_custom_module_without_arguments_is_switched():
    custom = NoArgumentCheckpointing()
    root = nn.Sequential(custom, nn.ReLU())
    checkpointing.enable(root, {"use_reentrant": False}, every_n_layers=2)
    assert custom.gradient_checkpointing and checkpointing.is_enabled(root)
    checkpointing.disable(root)
    assert not custom.gradient_checkpointing


def test_custom_module_without_disable_is_reported():
    class EnableOnly(nn.Module):
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            self.kwargs = gradient_checkpointing_kwargs

    module = EnableOnly()
    checkpointing.enable(nn.Sequential(module))
    assert module.kwargs == {"use_reentrant": False}
    with pytest.raises(CheckpointingNotSupportedError, match="no gradient_checkpointing_disable"):
        checkpointing.disable(nn.Sequential(module))


def checkpointing_warnings(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == checkpointing.__name__ and r.levelno == logging.WARNING
    ]


def static_embedding_model(model_class=SentenceTransformer, behind_router: bool = False):
    modules = st_modules()
    static = modules.StaticEmbedding(_static_tokenizer(), embedding_dim=8)
    first = modules.Asym({"query": [static], "doc": [static]}) if behind_router else static
    return model_class(modules=[first], device="cpu")


@pytest.mark.parametrize("behind_router", [False, True], ids=["alone", "behind_router"])
def test_model_with_nothing_to_checkpoint_warns_naming_its_modules(caplog, behind_router):
    """Upstream (4.1.0 and 6.2.0 alike) returns without checkpointing here; st_ext does too, but says so."""
    static_embedding_model(sentence_transformers.SentenceTransformer, behind_router).gradient_checkpointing_enable()
    model = static_embedding_model(behind_router=behind_router)
    with caplog.at_level(logging.WARNING, logger=checkpointing.__name__):
        assert model.gradient_checkpointing_enable() is None
    [message] = checkpointing_warnings(caplog)
    assert "StaticEmbedding" in message and "without gradient checkpointing" in message
    assert ("Asym" in message or "Router" in message) == behind_router
    assert not model.is_gradient_checkpointing and not model.is_activation_checkpointing
    caplog.clear()
    model.gradient_checkpointing_disable()
    model.activation_checkpointing_disable()
    assert checkpointing_warnings(caplog) == []


def test_module_declining_checkpointing_is_skipped_with_a_warning(tiny_bert_dir, caplog):
    """A Hugging Face model declaring supports_gradient_checkpointing=False makes transformers raise
    (and upstream 4.1.0 with it); 6.x skips it with a warning, and so does st_ext, on every version."""
    modules = st_modules()
    declining = modules.Transformer(str(tiny_bert_dir), max_seq_length=32)
    hf_declining = next(m for m in declining.modules() if _compat.is_hf_model(m))
    hf_declining.supports_gradient_checkpointing = False
    with pytest.raises(ValueError, match="does not support"):
        _compat.hf_checkpointing_enable(hf_declining, {})
    supporting = modules.Transformer(str(tiny_bert_dir), max_seq_length=32)
    router = modules.Asym({"query": [declining], "doc": [supporting]})
    model = SentenceTransformer(modules=[router, modules.Pooling(32)], device="cpu")
    with caplog.at_level(logging.WARNING, logger=checkpointing.__name__):
        [name] = checkpointing.enable(model)
    [message] = checkpointing_warnings(caplog)
    assert type(hf_declining).__name__ in message and "supports_gradient_checkpointing=False" in message
    assert model.get_submodule(name) is not hf_declining
    assert checkpointing.is_enabled(supporting) and not checkpointing.is_enabled(declining)


def test_kwargs_must_be_a_dict(tiny_bert_dir):
    model = sentence_transformer_from(tiny_bert_dir)
    with pytest.raises(TypeError, match="must be a dict"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="use_reentrant=False")


def _static_tokenizer():
    from tiny_models import build_tokenizer

    return build_tokenizer()._tokenizer


def activation_peak(model: SentenceTransformer, texts: list[str]) -> int:
    features = preprocess(model, texts)
    model.train()
    with measure_peak("cpu") as peak:
        embeddings = model(features)["sentence_embedding"]
        embeddings.pow(2).sum().backward()
    model.zero_grad(set_to_none=True)
    return peak.peak_bytes


def test_checkpointing_lowers_measured_activation_memory(tiny_bert6_dir):
    model = sentence_transformer_from(tiny_bert6_dir)
    texts = [" ".join(SENTENCES)] * 32
    plain = activation_peak(model, texts)
    model.gradient_checkpointing_enable()
    checkpointed = activation_peak(model, texts)
    model.gradient_checkpointing_disable()
    restored = activation_peak(model, texts)
    assert checkpointed < 0.7 * plain, (checkpointed, plain)
    assert restored == pytest.approx(plain, rel=0.05), (restored, plain)
