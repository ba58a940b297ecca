"""The names a training script imports from sentence-transformers resolve under st_ext.

The README's promise: ``from sentence_transformers import ...`` becomes ``from st_ext import ...`` (and the
same for ``.losses`` and ``.models``), and module paths st_ext does not have stay ``sentence_transformers``.
These tests compare the namespaces on the installed release: each top-level name, loss and module class
gives upstream's object under st_ext, except where st_ext replaces it (read from st_ext's declarations:
``st_ext._SOURCES`` and ``st_ext.losses.ST_EXT_LOSSES``), and then it is st_ext's own class.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from types import ModuleType

import pytest
import sentence_transformers

import st_ext
import st_ext.losses
import st_ext.models
from st_ext import _compat

pytestmark = pytest.mark.conformance

UPSTREAM = "sentence_transformers"


def declared_replacements() -> dict[int, tuple[object, object]]:
    """Upstream's object and st_ext's, by ``id`` of upstream's, for every upstream object st_ext replaces."""
    pairs = [
        (getattr(sentence_transformers, name), getattr(st_ext, name))
        for name, source in st_ext._SOURCES.items()
        if source != UPSTREAM and hasattr(sentence_transformers, name)
    ]
    upstream_losses = _compat.st_losses()
    pairs += [
        (getattr(upstream_losses, name), getattr(st_ext.losses, name))
        for name in st_ext.losses.ST_EXT_LOSSES
        if hasattr(upstream_losses, name)
    ]
    return {id(upstream): (upstream, ours) for upstream, ours in pairs}


REPLACED = declared_replacements()


def replacement(value: object) -> object:
    """What st_ext should answer where upstream answers ``value``."""
    entry = REPLACED.get(id(value))
    return entry[1] if entry is not None and entry[0] is value else value


# --- top-level names -------------------------------------------------------------------------------------


def test_the_declared_replacements_are_st_ext_classes():
    """The names st_ext declares as its own are st_ext's classes (a guard on the declarations the other tests
    read)."""
    assert REPLACED, "st_ext declares no replaced upstream object"
    for upstream, ours in REPLACED.values():
        assert ours is not upstream, upstream
        assert ours.__module__.startswith("st_ext."), ours
    replaced_names = {upstream.__name__ for upstream, _ in REPLACED.values()}
    assert {"SentenceTransformer", "CrossEncoder", "SentenceTransformerModelCardData"} <= replaced_names


@pytest.mark.parametrize("name", sorted(set(sentence_transformers.__all__) | {"util"}))
def test_every_upstream_top_level_name_resolves(name):
    expected = replacement(getattr(sentence_transformers, name))
    assert getattr(st_ext, name) is expected
    namespace: dict = {}
    exec(f"from st_ext import {name}", namespace)
    assert namespace[name] is expected


def test_all_and_star_import_cover_upstream_all():
    assert set(sentence_transformers.__all__) <= set(st_ext.__all__)
    namespace: dict = {}
    exec("from st_ext import *", namespace)
    for name in sentence_transformers.__all__:
        assert namespace[name] is replacement(getattr(sentence_transformers, name)), name
    assert namespace["losses"] is st_ext.losses and namespace["models"] is st_ext.models


def test_unknown_names_and_upstream_module_paths_are_not_st_ext_s():
    """st_ext answers no module path it does not have: ``sentence_transformers.evaluation`` stays upstream's."""
    assert not hasattr(st_ext, "NoSuchName")
    assert not hasattr(st_ext.models, "NoSuchModule")
    with pytest.raises(ImportError):
        exec("from st_ext import NoSuchName", {})
    for path in ("st_ext.evaluation", "st_ext.util", "st_ext.cross_encoder", "st_ext.models.tokenizer"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(path)
    assert not [finder for finder in sys.meta_path if type(finder).__module__.startswith("st_ext")]


@pytest.mark.parametrize(
    "name", sorted(name for name in st_ext._UPSTREAM_NAMES if not hasattr(sentence_transformers, name))
)
def test_an_upstream_name_the_installed_release_lacks_says_so(name):
    """A newer release's name (``resolve_ids`` on 4.x) is not offered, and asking for it names the release."""
    assert name not in st_ext.__all__ and not hasattr(st_ext, name)
    with pytest.raises(AttributeError, match=rf"^{name} is not in the installed sentence-transformers "):
        getattr(st_ext, name)


def test_importing_st_ext_does_not_import_torch():
    """``st-ext --help`` stays fast: the public names load on first use, not on ``import st_ext``."""
    heavy = "{'torch', 'sentence_transformers'}"
    code = f"import sys, st_ext; st_ext.__version__; print(sorted({heavy} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


# --- losses and models -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(_compat.st_losses().__all__))
def test_every_upstream_loss_name_is_in_st_ext_losses(name):
    expected = replacement(getattr(_compat.st_losses(), name))
    assert getattr(st_ext.losses, name) is expected
    assert name in st_ext.losses.__all__


@pytest.mark.parametrize("name", sorted(_compat.st_modules().__all__))
def test_every_upstream_module_class_is_in_st_ext_models(name):
    assert getattr(st_ext.models, name) is getattr(_compat.st_modules(), name)


# --- the README's promise --------------------------------------------------------------------------------

UPSTREAM_SCRIPT = """
from sentence_transformers import (
    InputExample,
    LoggingHandler,
    SentenceTransformer,
    SentenceTransformerModelCardData,
    SentenceTransformerTrainer,
    SentenceTransformerTrainingArguments,
    SimilarityFunction,
    losses,
    util,
)
from sentence_transformers import CrossEncoder, CrossEncoderTrainer
from sentence_transformers.losses import CachedMultipleNegativesRankingLoss, MultipleNegativesRankingLoss
from sentence_transformers.models import Pooling, Transformer

word_embedding_model = Transformer(MODEL_DIR)
pooling = Pooling(word_embedding_model.get_word_embedding_dimension())
model = SentenceTransformer(modules=[word_embedding_model, pooling])
embeddings = model.encode(["A cat sleeps.", "A cat is napping."], convert_to_tensor=True)
similarity = util.cos_sim(embeddings[:1], embeddings[1:])
"""
#: The lines of the script that name module paths st_ext does not have: they stay as they are.
UNCHANGED_LINES = """
from sentence_transformers.evaluation import EmbeddingSimilarityEvaluator, InformationRetrievalEvaluator
from sentence_transformers.training_args import BatchSamplers
from sentence_transformers.util import cos_sim, mine_hard_negatives
"""


def test_an_upstream_script_runs_after_swapping_the_import(tiny_bert_dir):
    upstream_namespace = {"MODEL_DIR": str(tiny_bert_dir)}
    st_ext_namespace = dict(upstream_namespace)
    exec(UNCHANGED_LINES + UPSTREAM_SCRIPT, upstream_namespace)
    exec(UNCHANGED_LINES + UPSTREAM_SCRIPT.replace("sentence_transformers", "st_ext"), st_ext_namespace)

    for name, value in upstream_namespace.items():
        if name.startswith("__") or name in ("word_embedding_model", "pooling", "model", "embeddings", "similarity"):
            continue
        if isinstance(value, ModuleType):  # `losses` is st_ext's module, `util` upstream's
            expected = st_ext.losses if name == "losses" else value
        else:
            expected = replacement(value)
        assert st_ext_namespace[name] is expected, name
    assert isinstance(st_ext_namespace["model"], st_ext.SentenceTransformer)
    assert type(st_ext_namespace["model"][0]) is type(upstream_namespace["model"][0])
    assert st_ext_namespace["similarity"].shape == upstream_namespace["similarity"].shape == (1, 1)
