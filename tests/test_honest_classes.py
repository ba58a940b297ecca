"""Every public class st_ext replaces is st_ext's own class, as Python sees it.

Its ``__module__`` is the st_ext module that defines it, so the class and its instances pickle (by st_ext's
path) and deep-copy, and ``inspect`` shows st_ext's source file. Model cards still name a replaced loss as the
upstream loss (tests/test_upstream_conformance.py); that is the card's business, not the class's.
"""

from __future__ import annotations

import copy
import inspect
import pickle
from pathlib import Path

import pytest
import sentence_transformers
import torch
from loss_checks import guide_from
from tiny_models import cross_encoder_from

import st_ext
from st_ext import _compat, losses

ST_EXT_DIR = Path(st_ext.__file__).parent
#: The public classes st_ext replaces at the top level: its models, trainers and model card data.
TOP_LEVEL_CLASSES = sorted(name for name, source in st_ext._SOURCES.items() if source.startswith("st_ext."))
LOSS_CLASSES = sorted(name for name in losses.ST_EXT_LOSSES if inspect.isclass(getattr(losses, name)))


def available(names: list[str]) -> list:
    """``names`` as test parameters, each skipped where the installed sentence-transformers lacks it."""
    return [
        pytest.param(
            name,
            marks=pytest.mark.skipif(
                _compat.missing_archetype_error(name) is not None, reason=str(_compat.missing_archetype_error(name))
            ),
        )
        for name in names
    ]


def public_class(name: str) -> type:
    return getattr(losses, name) if name in LOSS_CLASSES else getattr(st_ext, name)


@pytest.mark.parametrize("name", available(TOP_LEVEL_CLASSES) + LOSS_CLASSES)
def test_the_class_is_st_exts_own(name):
    cls = public_class(name)
    assert cls.__module__.startswith("st_ext.") and cls.__qualname__ == name
    assert pickle.loads(pickle.dumps(cls)) is cls
    assert copy.deepcopy(cls) is cls
    source = Path(inspect.getsourcefile(cls))
    assert source == Path(inspect.getsourcefile(inspect.getmodule(cls)))
    assert source.is_relative_to(ST_EXT_DIR), source
    assert f"class {name}(" in inspect.getsource(cls)


# --- instances on tiny local models -----------------------------------------------------------------------


def cached_mnrl(model):
    return losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=4)


def table(cls):
    return cls({b"a": 0}, torch.zeros(1, 4))


#: How to build an instance of each loss class on a SentenceTransformer ``m`` and a guide ``g``.
LOSS_INSTANCES = {
    "AdaptiveLayerLoss": lambda m, g: losses.AdaptiveLayerLoss(m, cached_mnrl(m)),
    "BatchAllTripletLoss": lambda m, g: losses.BatchAllTripletLoss(m),
    "BatchHardTripletLoss": lambda m, g: losses.BatchHardTripletLoss(m),
    "BatchSemiHardTripletLoss": lambda m, g: losses.BatchSemiHardTripletLoss(m),
    "CachedGISTEmbedLoss": lambda m, g: losses.CachedGISTEmbedLoss(m, g, mini_batch_size=4),
    "CachedMultipleNegativesRankingLoss": lambda m, g: cached_mnrl(m),
    "CachedMultipleNegativesSymmetricRankingLoss": lambda m, g: losses.CachedMultipleNegativesSymmetricRankingLoss(
        m, mini_batch_size=4
    ),
    "CrossBatchMemoryLoss": lambda m, g: losses.CrossBatchMemoryLoss(m, cached_mnrl(m), 8),
    "DistillationLoss": lambda m, g: losses.DistillationLoss(losses.MarginMSELoss(m), g),
    "EmbeddingLossSum": lambda m, g: losses.EmbeddingLossSum(
        cached_mnrl(m), {"gor": losses.GlobalOrthogonalRegularizationLoss(m)}
    ),
    "GISTEmbedLoss": lambda m, g: losses.GISTEmbedLoss(m, g),
    "GuideEmbeddings": lambda m, g: table(losses.GuideEmbeddings),
    "Matryoshka2dLoss": lambda m, g: losses.Matryoshka2dLoss(m, cached_mnrl(m), [32, 16]),
    "MatryoshkaLoss": lambda m, g: losses.MatryoshkaLoss(m, cached_mnrl(m), [32, 16]),
    "TeacherLabels": lambda m, g: table(losses.TeacherLabels),
}


def test_every_loss_class_has_an_instance_to_check():
    assert sorted(LOSS_INSTANCES) == LOSS_CLASSES


def model_instance(name: str, request):
    if name == "SentenceTransformer":
        return request.getfixturevalue("model")
    if name == "CrossEncoder":
        return cross_encoder_from(request.getfixturevalue("tiny_classifier_dir"))
    path = request.getfixturevalue("tiny_mlm_dir" if name == "SparseEncoder" else "tiny_bert_dir")
    return getattr(st_ext, name)(str(path), device="cpu")


def assert_round_trips(instance, cls: type) -> None:
    for twin in (pickle.loads(pickle.dumps(instance)), copy.deepcopy(instance)):
        assert type(twin) is cls
        if isinstance(instance, torch.nn.Module):
            assert twin.state_dict().keys() == instance.state_dict().keys()
            for key, value in instance.state_dict().items():
                assert torch.equal(twin.state_dict()[key], value), key


@pytest.mark.parametrize("name", LOSS_CLASSES)
def test_a_loss_instance_pickles_and_deep_copies(name, model, guide_dir):
    if name == "EmbeddingLossSum" and not _compat.trainer_sums_loss_terms():
        pytest.skip("4.x refuses EmbeddingLossSum (its trainer takes no loss of named terms)")
    cls = getattr(losses, name)
    instance = LOSS_INSTANCES[name](model, guide_from(guide_dir))
    assert type(instance) is cls
    assert_round_trips(instance, cls)


@pytest.mark.parametrize("name", available(list(st_ext._ARCHETYPES)))
def test_a_model_instance_pickles_and_deep_copies(name, request):
    instance = model_instance(name, request)
    assert_round_trips(instance, getattr(st_ext, name))


def test_a_model_card_data_instance_pickles_and_deep_copies(model):
    assert type(model.model_card_data) is st_ext.SentenceTransformerModelCardData
    assert_round_trips(model.model_card_data, st_ext.SentenceTransformerModelCardData)
    given = sentence_transformers.SentenceTransformerModelCardData(language="en")
    assert st_ext.SentenceTransformer(modules=list(model), model_card_data=given).model_card_data is given
    # Positionally where upstream's constructor takes it so (4.x): the user's card data is kept, never replaced.
    parameters = inspect.signature(sentence_transformers.SentenceTransformer.__init__).parameters
    if parameters["model_card_data"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
        names = list(parameters)[1:]
        positional = [None] * names.index("model_card_data")
        positional[names.index("modules")] = list(model)
        assert st_ext.SentenceTransformer(*positional, given).model_card_data is given


def round_trip(instance) -> tuple | type[Exception]:
    try:
        return pickle.loads(pickle.dumps(instance)), copy.deepcopy(instance)
    except Exception as error:  # what upstream's own class raises, st_ext's must raise alike
        return type(error)


@pytest.mark.parametrize("name", available([archetype + "Trainer" for archetype in st_ext._ARCHETYPES]))
def test_a_trainer_instance_pickles_and_deep_copies_where_upstreams_does(name, request, tmp_path):
    """Trainers hold what transformers' Trainer holds (4.x's keeps a weak reference, which never pickles)."""
    archetype = name.removesuffix("Trainer")
    model = model_instance(archetype, request)
    args = getattr(st_ext, archetype + "TrainingArguments")(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    ours = round_trip(getattr(st_ext, name)(model=model, args=args))
    theirs = round_trip(getattr(sentence_transformers, name)(model=model, args=args))
    if isinstance(theirs, type):
        assert ours is theirs
        return
    assert not isinstance(ours, type), ours
    for twin in ours:
        assert type(twin) is getattr(st_ext, name) and type(twin.model) is type(model)


def test_a_memory_callback_instance_pickles_and_deep_copies(model):
    instance = st_ext.CrossBatchMemoryCallback(losses.CrossBatchMemoryLoss(model, cached_mnrl(model), 8))
    assert_round_trips(instance, st_ext.CrossBatchMemoryCallback)
