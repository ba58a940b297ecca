"""Every upstream archetype: SparseEncoder and MultiVectorEncoder beside SentenceTransformer and CrossEncoder.

Each test runs where the installed sentence-transformers has the archetype (SparseEncoder from 5.0,
MultiVectorEncoder from 6.0) and checks the ImportError where it does not. The deprecation tests
tell st_ext's messages from transformers' own: with transformers 5, ``TrainingArguments(
gradient_checkpointing=True)`` itself warns that the keyword "will be removed in v6" (transformers'
message about the user's keyword), so the arguments are built before the capture starts.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import re
import warnings
from pathlib import Path

import pytest
import sentence_transformers
import torch
from test_trainer import RecordCheckpointing, pair_dataset, scored_pair_dataset, training_args
from tiny_models import SENTENCES, cross_encoder_from, sentence_transformer_from

import st_ext
import st_ext.models
import st_ext.training.trainer
from st_ext import _compat, checkpointing
from st_ext._compat import preprocess

pytestmark = pytest.mark.conformance

NEW_ARCHETYPES = ("SparseEncoder", "MultiVectorEncoder")
ALL_ARCHETYPES = ("SentenceTransformer", "CrossEncoder", *NEW_ARCHETYPES)
#: What transformers 5 says when a deprecated checkpointing name is called (or a model only offers one).
V6_DEPRECATION = re.compile(r"checkpointing.*(will be removed|no longer be called) in v6", re.S)
#: The Hugging Face methods st_ext should call on this transformers: never the deprecated ones.
PREFERRED_HF_SWITCHES = (
    ("activation_checkpointing_enable", "activation_checkpointing_disable")
    if _compat.HF_HAS_ACTIVATION_CHECKPOINTING
    else ("gradient_checkpointing_enable", "gradient_checkpointing_disable")
)


def archetypes(*names: str) -> list:
    """``names`` as test parameters, each skipped where the installed sentence-transformers lacks it."""
    return [
        pytest.param(
            name,
            id=name,
            marks=pytest.mark.skipif(
                _compat.missing_archetype_error(name) is not None,
                reason=str(_compat.missing_archetype_error(name)),
            ),
        )
        for name in names
    ]


def build(archetype: str, request, upstream: bool = False):
    """A tiny model of ``archetype``: st_ext's class, or upstream's own when ``upstream``."""
    model_class = getattr(sentence_transformers if upstream else st_ext, archetype)
    if archetype == "SentenceTransformer":
        return sentence_transformer_from(request.getfixturevalue("tiny_bert_dir"), model_class=model_class)
    if archetype == "CrossEncoder":
        return cross_encoder_from(request.getfixturevalue("tiny_classifier_dir"), model_class=model_class)
    # Upstream's default modules: SPLADE over a masked-LM checkpoint; a projection + mask + normalize over BERT.
    path = request.getfixturevalue("tiny_mlm_dir" if archetype == "SparseEncoder" else "tiny_bert_dir")
    return model_class(str(path), device="cpu")


OUTPUT_KEY = {"SparseEncoder": "sentence_embedding", "MultiVectorEncoder": "token_embeddings"}


def trainer_for(archetype: str, model, tmp_path, callbacks=(), **overrides):
    """A 2-step trainer of ``archetype`` with upstream's default loss (SentenceTransformer: MNRL; CrossEncoder: BCE)."""
    args = training_args(getattr(st_ext, f"{archetype}TrainingArguments"), tmp_path / "out", **overrides)
    return trainer_with_args(archetype, model, args, callbacks)


def trainer_with_args(archetype: str, model, args, callbacks=(), **options):
    dataset, loss = pair_dataset(), None
    if archetype == "SentenceTransformer":
        loss = _compat.st_losses().MultipleNegativesRankingLoss(model)
    elif archetype == "CrossEncoder":
        from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss

        dataset, loss = scored_pair_dataset(), BinaryCrossEntropyLoss(model)
    trainer_class = getattr(st_ext, f"{archetype}Trainer")
    return trainer_class(
        model=model, args=args, train_dataset=dataset, loss=loss, callbacks=list(callbacks), **options
    )


# --- imports on every version ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(_compat.ARCHETYPE_OF_NAME))
def test_archetype_names_import_or_name_the_release_they_need(name):
    error = _compat.missing_archetype_error(name)
    if error is None:
        value = getattr(importlib.import_module("st_ext"), name)
        assert name in st_ext.__all__
        assert issubclass(value, getattr(sentence_transformers, name))
        return
    assert name not in st_ext.__all__
    since = _compat.ARCHETYPE_SINCE[_compat.ARCHETYPE_OF_NAME[name]]
    installed = re.escape(str(_compat.ST_VERSION))
    expected = rf"{name} needs sentence-transformers >= {re.escape(str(since))}.*{installed} is installed"
    home = "models" if name in _compat.ARCHETYPE_SINCE else "training.trainer" if name.endswith("Trainer") else None
    for module in ["st_ext"] + ([f"st_ext.{home}"] if home else []):
        with pytest.raises(ImportError, match=expected):
            exec(f"from {module} import {name}", {})


def test_star_import_matches_all_and_unknown_names_stay_attribute_errors():
    namespace: dict = {}
    exec("from st_ext import *", namespace)
    assert {name for name in namespace if not name.startswith("__")} == set(st_ext.__all__) - {"__version__"}
    assert not hasattr(st_ext, "SparseEncoderz") and not hasattr(st_ext.models, "Nothing")


def test_missing_archetype_message_names_both_releases(monkeypatch):
    """The message itself, on any installed version: pretend 4.1.0 is installed."""
    monkeypatch.setattr(_compat, "ST_VERSION", _compat.Version("4.1.0"))
    installed = r".*sentence-transformers 4\.1\.0 is installed"
    needs = "needs sentence-transformers >= "
    with pytest.raises(ImportError, match=rf"^MultiVectorEncoderTrainer {needs}6\.0\.0 {installed}"):
        st_ext.__getattr__("MultiVectorEncoderTrainer")
    with pytest.raises(ImportError, match=rf"^SparseEncoder {needs}5\.0\.0 {installed}"):
        st_ext.models.__getattr__("SparseEncoder")


# --- checkpointing switches --------------------------------------------------------------------------------


def layer_flags(model) -> list[bool]:
    """The ``gradient_checkpointing`` flag of every module that carries one (transformers' per-layer switch)."""
    return [module.gradient_checkpointing for module in model.modules() if hasattr(module, "gradient_checkpointing")]


def output_grads(model, archetype: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Gradients of a fixed non-linear function of the model's output, dropout active, fixed RNG seed."""
    model.train()
    model.zero_grad(set_to_none=True)
    features = preprocess(model, SENTENCES)
    torch.manual_seed(seed)
    output = model(features)[OUTPUT_KEY[archetype]]
    direction = torch.randn(output.shape[-1], generator=torch.Generator().manual_seed(1))
    (output @ direction).pow(2).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("archetype", archetypes(*NEW_ARCHETYPES))
def test_switches_reach_every_layer_and_keep_gradients(archetype, request, one_torch_thread):
    model = build(archetype, request)
    flags = layer_flags(model)
    assert flags and not any(flags)
    reference = output_grads(model, archetype)

    model.gradient_checkpointing_enable()
    assert all(layer_flags(model)) and model.is_gradient_checkpointing and model.is_activation_checkpointing
    checkpointed = output_grads(model, archetype)
    assert checkpointed.keys() == reference.keys() and len(reference) > 4
    for name in reference:
        torch.testing.assert_close(checkpointed[name], reference[name], rtol=1e-5, atol=1e-6, msg=name)
    other_seed = output_grads(model, archetype, seed=1)  # dropout is on: the equality above is not vacuous
    assert any(not torch.allclose(other_seed[name], reference[name]) for name in reference)

    model.activation_checkpointing_disable()
    assert not any(layer_flags(model)) and not model.is_gradient_checkpointing
    model.activation_checkpointing_enable()
    assert all(layer_flags(model)) and model.is_activation_checkpointing


# --- trainers ----------------------------------------------------------------------------------------------


def model_outputs(model, archetype: str) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(preprocess(model, SENTENCES[:3]))[OUTPUT_KEY[archetype]]


@pytest.mark.parametrize("upstream", [False, True], ids=["st_ext_model", "upstream_model"])
@pytest.mark.parametrize("archetype", archetypes(*NEW_ARCHETYPES))
def test_trainer_checkpoints_every_step_and_saves_an_upstream_model(archetype, upstream, request, tmp_path):
    model = build(archetype, request, upstream=upstream)
    before = model_outputs(model, archetype)
    recorder = RecordCheckpointing(model)
    trainer_for(archetype, model, tmp_path, callbacks=[recorder]).train()
    assert recorder.steps == [(True, False), (True, False)]
    after = model_outputs(model, archetype)
    assert not torch.allclose(after, before)
    if upstream:  # the switches lent for train() are taken back
        assert type(model) is getattr(sentence_transformers, archetype)
        assert "activation_checkpointing_enable" not in vars(model)
    model.save_pretrained(str(tmp_path / "saved"))
    loaded = getattr(sentence_transformers, archetype)(str(tmp_path / "saved"), device="cpu")
    torch.testing.assert_close(model_outputs(loaded, archetype), after, rtol=1e-4, atol=1e-5)


def test_new_archetypes_losses_hold_no_teacher_or_guide():
    """Why SparseEncoderTrainer/MultiVectorEncoderTrainer take frozen_encoders='resident' only: their upstream
    losses receive teacher scores as labels, and none takes a teacher or guide model to offload or precompute."""
    namespaces = {"SparseEncoder": "sparse_encoder", "MultiVectorEncoder": "multi_vector_encoder"}
    checked = 0
    for archetype, package in namespaces.items():
        if _compat.missing_archetype_error(archetype) is not None:
            continue
        losses = importlib.import_module(f"sentence_transformers.{package}.losses")
        for name in losses.__all__:
            parameters = inspect.signature(getattr(losses, name).__init__).parameters
            encoders = [p for p in parameters if ("teacher" in p or "guide" in p) and not p.endswith("temperature")]
            assert encoders == [], name
            checked += 1
    if not checked:
        pytest.skip(f"sentence-transformers {_compat.ST_VERSION} has neither archetype")


@pytest.mark.parametrize("archetype", archetypes(*NEW_ARCHETYPES))
def test_frozen_encoders_is_resident_only(archetype, request, tmp_path):
    model = build(archetype, request)
    args = training_args(getattr(st_ext, f"{archetype}TrainingArguments"), tmp_path / "out")
    assert trainer_with_args(archetype, model, args, frozen_encoders="resident").frozen_encoders == "resident"
    for mode in ("offload", "precompute"):
        with pytest.raises(ValueError, match=rf"{archetype}Trainer accepts only frozen_encoders='resident'.*GIST"):
            trainer_with_args(archetype, model, args, frozen_encoders=mode)
    with pytest.raises(ValueError, match="must be one of"):
        trainer_with_args(archetype, model, args, frozen_encoders="cpu")


# --- no transformers-v6 deprecation of st_ext's making ------------------------------------------------------


@contextlib.contextmanager
def captured_messages():
    """Every warning and every log record while the block runs; the list is complete once the block ends.

    transformers' loggers do not propagate to the root logger, so its library logger gets the handler
    too; ``warning_once`` caches are cleared so that an earlier test cannot hide a message.
    """
    messages: list[str] = []
    handler = logging.Handler(level=logging.DEBUG)
    handler.emit = lambda record: messages.append(f"{record.name}: {record.getMessage()}")
    loggers = [logging.getLogger(), logging.getLogger("transformers")]
    getattr(logging.Logger.warning_once, "cache_clear", lambda: None)()
    for logger in loggers:
        logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield messages
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    messages.extend(f"{w.category.__name__} ({w.filename}): {w.message}" for w in caught)


def spy_on_switches(model) -> list[str]:
    """Record calls of the preferred Hugging Face switches on every model st_ext switches.

    Only the preferred names are wrapped: on transformers 5 an instance attribute named like a
    deprecated method counts as an override, which ``activation_checkpointing_enable`` would then call.
    """
    calls: list[str] = []
    for _, module in checkpointing.checkpointable_modules(model):
        for name in PREFERRED_HF_SWITCHES:
            method = getattr(module, name)

            @functools.wraps(method)
            def recording(*args, _name=name, _method=method, **kwargs):
                calls.append(_name)
                return _method(*args, **kwargs)

            setattr(module, name, recording)
    return calls


#: The installed package's own folder: a warning is st_ext's when its file lies inside it (a clone or a
#: virtual environment may well sit in a folder named st_ext too).
ST_EXT_PACKAGE_DIR = Path(st_ext.__file__).resolve().parent


def is_st_ext_file(filename: str) -> bool:
    return Path(filename).resolve().is_relative_to(ST_EXT_PACKAGE_DIR)


def test_a_warning_is_st_exts_by_the_packages_location_not_a_folder_name(tmp_path):
    """A clone in a folder named st_ext keeps its virtual environment inside it: transformers' files there
    are not st_ext's."""
    clone_venv_file = tmp_path / "st_ext" / ".venv" / "lib" / "site-packages" / "transformers" / "training_args.py"
    assert not is_st_ext_file(str(clone_venv_file))
    assert is_st_ext_file(checkpointing.__file__)
    message = f"FutureWarning ({clone_venv_file}): `evaluation_strategy` is deprecated"
    assert st_ext_made([message]) == []


def st_ext_made(messages: list[str]) -> list[str]:
    """Deprecations of transformers' v6 names, and any deprecation warning attributed to st_ext's own files."""
    deprecation = re.compile(r"^(?:DeprecationWarning|FutureWarning) \((?P<file>.*?)\): ")
    from_st_ext = [m for m in messages if (found := deprecation.match(m)) and is_st_ext_file(found["file"])]
    return [m for m in messages if V6_DEPRECATION.search(m)] + from_st_ext


@pytest.mark.parametrize("archetype", archetypes(*ALL_ARCHETYPES))
def test_checkpointing_uses_transformers_current_names_only(archetype, request, tmp_path, one_torch_thread):
    """Every switch, every property and a 2-step training run: only the names this transformers prefers are
    called on the Hugging Face models (the old ones on transformers 4), and nothing says "removed in v6"."""
    model = build(archetype, request)
    args = training_args(
        getattr(st_ext, f"{archetype}TrainingArguments"), tmp_path / "out"
    )  # see the module docstring
    calls = spy_on_switches(model)
    recorder = RecordCheckpointing(model)
    with captured_messages() as messages:
        model.gradient_checkpointing_enable()
        assert model.is_gradient_checkpointing and model.is_activation_checkpointing
        model.gradient_checkpointing_disable()
        model.activation_checkpointing_enable()
        model.activation_checkpointing_disable()
        assert not model.is_gradient_checkpointing and not model.is_activation_checkpointing
        trainer_with_args(archetype, model, args, callbacks=[recorder]).train()
    assert st_ext_made(messages) == []
    assert recorder.steps == [(True, False), (True, False)]
    assert set(calls) == set(PREFERRED_HF_SWITCHES) and calls.count(PREFERRED_HF_SWITCHES[0]) == 3


@pytest.mark.parametrize("archetype", archetypes(*ALL_ARCHETYPES))
def test_st_ext_trainer_on_an_upstream_model_uses_current_names_only(archetype, request, tmp_path, one_torch_thread):
    """The switches st_ext's trainer lends to a plain upstream model for train() are st_ext's too."""
    model = build(archetype, request, upstream=True)
    args = training_args(getattr(st_ext, f"{archetype}TrainingArguments"), tmp_path / "out", max_steps=1)
    calls = spy_on_switches(model)
    with captured_messages() as messages:
        trainer_with_args(archetype, model, args).train()
    assert st_ext_made(messages) == []
    assert calls == [PREFERRED_HF_SWITCHES[0]] * len(checkpointing.checkpointable_modules(model))


@pytest.mark.skipif(not _compat.HF_HAS_ACTIVATION_CHECKPOINTING, reason="transformers 4 deprecates nothing here")
def test_upstream_alone_logs_the_v6_deprecations(request, tmp_path):
    """Reference for the test above: upstream's trainer on upstream's CrossEncoder (6.x) is told that
    ``gradient_checkpointing_enable`` will no longer be called in v6, then calls transformers' deprecated
    method. The same capture sees both, so its silence above is real."""
    model = build("CrossEncoder", request, upstream=True)
    args = training_args(st_ext.CrossEncoderTrainingArguments, tmp_path / "out", max_steps=1)
    from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss

    trainer = sentence_transformers.CrossEncoderTrainer(
        model=model, args=args, train_dataset=scored_pair_dataset(), loss=BinaryCrossEntropyLoss(model)
    )
    with captured_messages() as messages:
        trainer.train()
    found = st_ext_made(messages)
    assert any("no longer be called in v6" in m for m in found)
    assert any("`gradient_checkpointing_enable` is deprecated and will be removed in v6" in m for m in found)


def test_training_argument_deprecation_is_transformers_own(tmp_path):
    """``gradient_checkpointing=True`` in the training arguments: transformers 5 warns about the keyword
    itself (st_ext re-exports upstream's argument classes unchanged); st_ext adds nothing to it."""
    with captured_messages() as messages:
        training_args(st_ext.SentenceTransformerTrainingArguments, tmp_path / "out")
    found = st_ext_made(messages)
    expected = 1 if _compat.HF_HAS_ACTIVATION_CHECKPOINTING else 0
    assert len(found) == expected and all("`gradient_checkpointing` is deprecated" in m for m in found)
    assert "transformers/training_args.py" in "".join(found) or not found
