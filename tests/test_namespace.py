"""Every public name and module path of the installed sentence-transformers resolves under st_ext.

The README's promise is that a training script needs one change: ``sentence_transformers`` becomes ``st_ext``
in its imports. These tests compare the two namespaces mechanically on the installed release: each top-level
name, and each module path (found with ``pkgutil``, plus the deprecated paths 5.4+ still answers), gives
upstream's object under st_ext, except where st_ext replaces the object (read from st_ext's own declarations:
``st_ext._SOURCES`` and ``st_ext.losses.ST_EXT_LOSSES``) or defines the module itself.
"""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from types import ModuleType

import pytest
import sentence_transformers

import st_ext
import st_ext.losses
from st_ext import _compat

pytestmark = pytest.mark.conformance

UPSTREAM = "sentence_transformers"
ST_EXT_DIR = st_ext.__path__[0]


def st_ext_path(path: str) -> str:
    """``sentence_transformers.evaluation`` -> ``st_ext.evaluation``."""
    return "st_ext" + path[len(UPSTREAM) :]


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
    """What st_ext should answer where upstream answers ``value`` (not a module)."""
    entry = REPLACED.get(id(value))
    return entry[1] if entry is not None and entry[0] is value else value


def public_module_paths() -> list[str]:
    """Upstream's module paths without a private part: the installed files, and the old paths of moved
    modules that 5.4+ keeps answering (with a DeprecationWarning)."""
    walk = pkgutil.walk_packages(sentence_transformers.__path__, f"{UPSTREAM}.", onerror=lambda _: None)
    paths = {info.name for info in walk}
    try:
        from sentence_transformers.util.deprecated_import import DEPRECATED_MODULE_PATHS
    except ImportError:  # before 5.4 nothing moved
        DEPRECATED_MODULE_PATHS = {}
    paths.update(DEPRECATED_MODULE_PATHS)
    return sorted(path for path in paths if not any(part.startswith("_") for part in path.split(".")))


MODULE_PATHS = public_module_paths()


def import_upstream(path: str) -> ModuleType:
    """Upstream's module, or a skip naming the optional dependency it needs where that is not installed."""
    try:
        return importlib.import_module(path)
    except ImportError as error:
        if error.name and error.name.split(".")[0] != UPSTREAM:
            pytest.skip(f"{path} needs {error.name!r}, an optional dependency that is not installed")
        raise


def documented_names(module: ModuleType) -> list[str]:
    """The names ``module`` offers: its ``__all__``, else what it defines itself (not what it imports)."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__
    ]


def expected_attribute(st_ext_module_name: str, upstream_module: ModuleType, name: str) -> object:
    """What ``getattr(st_ext_module, name)`` should be: st_ext's module of the same path for a submodule,
    st_ext's object for one it replaces, upstream's otherwise."""
    value = getattr(upstream_module, name)
    upstream_name = f"{UPSTREAM}{st_ext_module_name[len('st_ext') :]}.{name}"
    if isinstance(value, ModuleType) and sys.modules.get(upstream_name) is value:
        return importlib.import_module(f"{st_ext_module_name}.{name}")
    return replacement(value)


# --- top-level names -------------------------------------------------------------------------------------


def upstream_top_level_names() -> list[str]:
    return sorted(
        set(sentence_transformers.__all__) | {n for n in dir(sentence_transformers) if not n.startswith("_")}
    )


def test_the_declared_replacements_are_st_ext_objects():
    """The names st_ext declares as its own replace upstream's objects (a guard on the declarations the
    other tests read)."""
    assert REPLACED, "st_ext declares no replaced upstream object"
    for upstream, ours in REPLACED.values():
        assert ours is not upstream, upstream
    assert {"SentenceTransformer", "CrossEncoder"} <= {upstream.__name__ for upstream, _ in REPLACED.values()}


@pytest.mark.parametrize("name", upstream_top_level_names())
def test_every_upstream_top_level_name_resolves(name):
    expected = expected_attribute("st_ext", sentence_transformers, name)
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
    assert not [name for name in set(dir(sentence_transformers)) - set(dir(st_ext)) if not name.startswith("_")]


def test_unknown_names_stay_attribute_errors():
    assert not hasattr(st_ext, "NoSuchName")
    assert not hasattr(st_ext.models, "NoSuchModule")
    with pytest.raises(ImportError):
        exec("from st_ext import NoSuchName", {})
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("st_ext.no_such_module")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("st_ext.evaluation.no_such_module")


def test_importing_st_ext_does_not_import_torch():
    """``st-ext --help`` stays fast: the upstream names and paths load on first use, not on ``import st_ext``."""
    heavy = "{'torch', 'sentence_transformers'}"
    code = f"import sys, st_ext; st_ext.__version__; print(sorted({heavy} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


# --- module paths ----------------------------------------------------------------------------------------


def test_the_walk_finds_the_paths_scripts_use():
    """A guard on the enumeration itself: the module paths the issue names are among those checked."""
    assert {f"{UPSTREAM}.{name}" for name in ("evaluation", "training_args", "models", "losses", "util")} <= set(
        MODULE_PATHS
    )


@pytest.mark.parametrize("path", MODULE_PATHS)
def test_every_upstream_module_path_imports_under_st_ext(path):
    upstream = import_upstream(path)
    name = st_ext_path(path)
    parent_name, _, child = name.rpartition(".")
    importlib.import_module(parent_name)
    parent = sys.modules[parent_name]
    upstream_parent = sys.modules[path.rpartition(".")[0]]
    watched = {id(parent): parent, id(upstream_parent): upstream_parent}
    before = {key: dict(vars(module)) for key, module in watched.items()}

    module = importlib.import_module(name)

    assert sys.modules[name] is module
    if module is not upstream:
        # st_ext's own module (a file of st_ext, or one that reads through to upstream's): it offers
        # upstream's names, with st_ext's object where st_ext replaces one.
        assert module.__name__ == name
        origin = module.__spec__.origin
        assert origin is None or origin.startswith(ST_EXT_DIR), f"{name} is a second copy of {origin}"
        for attribute in documented_names(upstream):
            assert getattr(module, attribute) is expected_attribute(name, upstream, attribute), attribute
    elif parent.__name__ == parent_name:
        # Upstream's module below one of st_ext's: it must not offer an object st_ext replaces, or
        # `from st_ext.<path> import <Name>` would hand out upstream's.
        held = [key for key in documented_names(upstream) if replacement(value := getattr(upstream, key)) is not value]
        assert not held, f"{name} is upstream's module but offers {held}, which st_ext replaces"
    # Importing the path rebinds nothing: upstream's modules keep their attributes, and a parent that
    # answers the child's name with a class keeps the class.
    for key, module_before in before.items():
        now = vars(watched[key])
        changed = [attribute for attribute, value in module_before.items() if now.get(attribute, value) is not value]
        assert not changed, f"importing {name} rebound {changed} on {watched[key].__name__}"
    via_parent = getattr(parent, child)
    assert via_parent is module or not isinstance(via_parent, ModuleType)


def test_a_deprecated_path_warns_at_the_importers_line_with_st_exts_paths():
    """Upstream 5.4+ warns about its moved paths; through st_ext the warning names st_ext's paths and points at
    the script's import, as upstream's would (never at st_ext's files)."""
    code = (
        "import warnings; warnings.simplefilter('always')\n"
        "from st_ext.evaluation import InformationRetrievalEvaluator\n"
        "import st_ext.models.Transformer\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    ours = [line for line in result.stderr.splitlines() if "DeprecationWarning: Importing from 'st_ext" in line]
    if "sentence_transformers.evaluation" not in getattr(
        sys.modules.get("sentence_transformers.util.deprecated_import"), "DEPRECATED_MODULE_PATHS", {}
    ):
        assert ours == [], "nothing is deprecated before 5.4"
        return
    assert ours[0].startswith("<string>:2: DeprecationWarning: Importing from 'st_ext.evaluation' is deprecated")
    assert "Please use 'st_ext.sentence_transformer.evaluation' instead" in ours[0]
    assert all(line.startswith("<string>:") for line in ours), ours
    assert not [line for line in ours if "'st_ext.models'" in line], "st_ext.models is st_ext's own module"


def test_a_submodule_alias_is_upstreams_module_object(monkeypatch):
    """Where st_ext does not define a path, it is upstream's module itself: monkeypatching either is both."""
    import sentence_transformers.evaluation
    import sentence_transformers.util

    import st_ext.evaluation
    import st_ext.util

    assert st_ext.util is sentence_transformers.util
    assert st_ext.evaluation is sentence_transformers.evaluation
    monkeypatch.setattr(st_ext.util, "cos_sim", "patched")
    assert sentence_transformers.util.cos_sim == "patched"
    evaluator = sentence_transformers.evaluation.InformationRetrievalEvaluator
    assert st_ext.evaluation.InformationRetrievalEvaluator is evaluator


def test_modules_that_hold_a_replaced_class_answer_st_exts():
    from st_ext.cross_encoder import CrossEncoder, CrossEncoderTrainer
    from st_ext.losses import MatryoshkaLoss

    assert CrossEncoder is st_ext.CrossEncoder and CrossEncoderTrainer is st_ext.CrossEncoderTrainer
    assert importlib.import_module("st_ext.losses.MatryoshkaLoss").MatryoshkaLoss is MatryoshkaLoss
    assert importlib.import_module("st_ext.SentenceTransformer").SentenceTransformer is st_ext.SentenceTransformer
    assert st_ext.SentenceTransformer.__module__ == "st_ext.models"  # the class, not the module of that path


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
from sentence_transformers.cross_encoder import CrossEncoder, CrossEncoderTrainer
from sentence_transformers.evaluation import EmbeddingSimilarityEvaluator, InformationRetrievalEvaluator
from sentence_transformers.losses import CachedMultipleNegativesRankingLoss, MultipleNegativesRankingLoss
from sentence_transformers.models import Pooling, Transformer
from sentence_transformers.training_args import BatchSamplers
from sentence_transformers.util import cos_sim, mine_hard_negatives

word_embedding_model = Transformer(MODEL_DIR)
pooling = Pooling(word_embedding_model.get_word_embedding_dimension())
model = SentenceTransformer(modules=[word_embedding_model, pooling])
embeddings = model.encode(["A cat sleeps.", "A cat is napping."], convert_to_tensor=True)
similarity = cos_sim(embeddings[:1], embeddings[1:])
"""


def test_an_upstream_script_runs_after_swapping_the_import(tiny_bert_dir):
    upstream_namespace = {"MODEL_DIR": str(tiny_bert_dir)}
    st_ext_namespace = dict(upstream_namespace)
    exec(UPSTREAM_SCRIPT, upstream_namespace)
    exec(UPSTREAM_SCRIPT.replace("sentence_transformers", "st_ext"), st_ext_namespace)

    for name, value in upstream_namespace.items():
        if name.startswith("__") or name in ("word_embedding_model", "pooling", "model", "embeddings", "similarity"):
            continue
        if isinstance(value, ModuleType):  # `losses` and `util`, imported from the top level
            expected = importlib.import_module(f"st_ext.{name}")
        else:
            expected = replacement(value)
        assert st_ext_namespace[name] is expected, name
    assert isinstance(st_ext_namespace["model"], st_ext.SentenceTransformer)
    assert type(st_ext_namespace["model"][0]) is type(upstream_namespace["model"][0])
    assert st_ext_namespace["similarity"].shape == upstream_namespace["similarity"].shape == (1, 1)
