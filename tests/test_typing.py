"""A type checker reads st_ext as it reads upstream: the classes Python runs, their arguments, inherited methods.

mypy checks scripts a user could write (each written to ``tmp_path``), in a subprocess of this environment's
Python, and only the script's own lines are reported:

- a script that imports every public name st_ext replaces and ``reveal_type``s each of st_ext's classes: mypy
  names the class Python runs (its ``st_ext.`` path), not ``Any`` (upstream not followed: fast, and exact on
  every release);
- a training script with one deliberate mistake per line (:data:`MISTAKES`): mypy reports each of those lines
  and no other, and the same script without the mistakes reports nothing;
- ``reveal_type`` of the methods st_ext's classes inherit (``encode``, ``similarity``, the trainer's ``train``)
  equals that of upstream's classes, and each constructor a checker reads takes the parameters Python binds,
  in that order (upstream's positional ones, then st_ext's keyword-only ones).

The last two follow upstream's packages (their annotations are part of what a user's checker sees) and share one
mypy cache, so the second run reads what the first one parsed.
"""

from __future__ import annotations

import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sentence_transformers

import st_ext
from st_ext import _compat, losses

ROOT = Path(__file__).resolve().parents[1]
#: Upstream's packages skipped: a checker reads st_ext's modules and names, nothing of upstream's types.
SKIPPING_UPSTREAM = """
[mypy]
mypy_path = {root}
cache_dir = {cache}
follow_imports = skip
follow_imports_for_stubs = True
ignore_missing_imports = True
warn_unused_configs = False

[mypy-st_ext.*]
follow_imports = silent
"""
#: Upstream's packages followed, as a user's checker follows them (they ship py.typed); libraries without
#: annotations are Any, as in pyproject.toml.
FOLLOWING_UPSTREAM = """
[mypy]
mypy_path = {root}
cache_dir = {cache}
follow_imports = silent
warn_unused_configs = False

[mypy-accelerate.*,datasets.*,deepspeed.*,tqdm.*,yaml.*]
ignore_missing_imports = True
"""
ON_6X = _compat.ST_VERSION.major >= 6
NOT_ON_4X_REASON = (
    "st_ext's checker-visible constructors and upstream base classes are those of sentence-transformers 6.x "
    "(upstream's module paths moved in 5.4); on {installed} a checker reads st_ext's own names only"
)

#: A training script: per line its correct form and the same line with one mistake a checker must catch.
MISTAKES = [
    ("from st_ext import SentenceTransformer, SentenceTransformerTrainer, CrossEncoder, losses", None),
    ("from st_ext.losses import CachedMultipleNegativesRankingLoss, MatryoshkaLoss", None),
    ("from st_ext import CrossEncoderTrainer", "from st_ext import CrossEncoderTrainr"),
    ("from st_ext.losses import GISTEmbedLoss as Guided", "from st_ext.losses import GISTEmbedLos as Guided"),
    ("from datasets import Dataset", None),
    ('model = SentenceTransformer("tiny", device="cpu")', 'model = SentenceTransformer("tiny", devise="cpu")'),
    ('reranker = CrossEncoder("tiny", num_labels=1)', 'reranker = CrossEncoder("tiny", num_label=1)'),
    ('dataset = Dataset.from_dict({"anchor": ["a"], "positive": ["b"]})', None),
    (
        "cached = CachedMultipleNegativesRankingLoss(model, mini_batch_size=16)",
        'cached = CachedMultipleNegativesRankingLoss(model, mini_batch_size="big")',
    ),
    (
        'auto = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size="auto", memory_budget_mb=512)',
        'auto = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size="auto", memory_budget=512)',
    ),
    (
        "gist = losses.CachedGISTEmbedLoss(model, model, mini_batch_size=8, offload_guide=True)",
        'gist = losses.CachedGISTEmbedLoss(model, model, mini_batch_size="big", offload_guide=True)',
    ),
    (
        "loss = MatryoshkaLoss(model, cached, matryoshka_dims=[768, 512, 256])",
        'loss = MatryoshkaLoss(model, cached, matryoshka_dims="768")',
    ),
    (
        "layers = losses.AdaptiveLayerLoss(model, cached, n_layers_per_step=2)",
        "layers = losses.AdaptiveLayerLoss(model, cached, n_layer_per_step=2)",
    ),
    (
        "memory = losses.CrossBatchMemoryLoss(model, losses.MultipleNegativesRankingLoss(model), memory_size=4096)",
        'memory = losses.CrossBatchMemoryLoss(model, losses.MultipleNegativesRankingLoss(model), memory_size="a lot")',
    ),
    (
        'trainer = SentenceTransformerTrainer(model=model, train_dataset=dataset, loss=loss, frozen_encoders="offload")',
        "trainer = SentenceTransformerTrainer(model=model, train_dataset=dataset, lossy=loss)",
    ),
    ("trainer.train()", "trainer.train(resume_from_checkpoint=1.5)"),
    ('embeddings = model.encode(["a query"], batch_size=2)', 'embeddings = model.encode(["a query"], batch_size="2")'),
]


def st_ext_classes() -> dict[str, type]:
    """Every public class st_ext replaces that the installed release has, by the name a script imports."""
    top_level = {
        name: getattr(st_ext, name)
        for name, source in st_ext._SOURCES.items()
        if source.startswith("st_ext.") and _compat.missing_archetype_error(name) is None
    }
    loss_classes = {name: getattr(losses, name) for name in losses.ST_EXT_LOSSES}
    return {**top_level, **{name: cls for name, cls in loss_classes.items() if inspect.isclass(cls)}}


def user_script() -> tuple[str, list[str]]:
    """A training script's imports and a ``reveal_type`` per st_ext class; the qualified names expected."""
    classes = st_ext_classes()
    top_level = [name for name in classes if name in st_ext._SOURCES]
    own_losses = [name for name in classes if name not in st_ext._SOURCES]
    upstream_top_level = sorted(
        name for name in st_ext.__all__ if st_ext._SOURCES.get(name) == "sentence_transformers"
    )
    lines = [
        f"from st_ext import {', '.join(top_level + upstream_top_level)}",
        f"from st_ext.losses import {', '.join(own_losses)}",
        f"from st_ext.models import {', '.join(sorted(_compat.st_modules().__all__))}",
        "from st_ext import losses, models",
        *(f"losses.{name}" for name in sorted(_compat.st_losses().__all__)),
        "util.cos_sim",
    ]
    expected = []
    for name, cls in classes.items():
        lines.append(f"reveal_type({name})")
        expected.append(f"{cls.__module__}.{cls.__qualname__}")
    lines.append("reveal_type(losses.MatryoshkaLoss)")
    expected.append("st_ext.losses.matryoshka.MatryoshkaLoss")
    return "\n".join(lines) + "\n", expected


def run_mypy(script: str, directory: Path, config: str, cache: Path) -> list[str]:
    """mypy's report on ``script``: its error, note and revealed-type lines."""
    pytest.importorskip("mypy", reason="mypy is in requirements/test.txt")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "train.py"
    path.write_text(script)
    config_path = directory / "mypy.ini"
    config_path.write_text(config.format(root=ROOT, cache=cache))
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(config_path), "--no-error-summary", str(path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=directory,
    )
    assert result.returncode in (0, 1), result.stdout + result.stderr
    return result.stdout.splitlines()


def error_lines(output: list[str]) -> list[int]:
    """The script's line numbers mypy reports an error at, once each."""
    return sorted({int(line.split(":")[1]) for line in output if ": error:" in line})


def revealed(output: list[str]) -> list[str]:
    return [re.search(r'Revealed type is "(.*)"', line).group(1) for line in output if "Revealed type" in line]


@pytest.fixture(scope="module")
def following_cache(tmp_path_factory) -> Path:
    """One mypy cache for the runs that follow upstream: torch and transformers are parsed once."""
    return tmp_path_factory.mktemp("mypy_cache")


def test_a_training_script_sees_st_exts_classes(tmp_path):
    script, expected = user_script()
    output = run_mypy(script, tmp_path, SKIPPING_UPSTREAM, tmp_path / "cache")
    errors = [line for line in output if ": error:" in line]
    assert not errors, "\n".join(errors)
    shown_types = revealed(output)
    assert len(shown_types) == len(expected), output
    for qualified_name, shown in zip(expected, shown_types):
        assert re.search(rf"(^|[ >\[]){re.escape(qualified_name)}($|\W)", shown), (qualified_name, shown)
        assert "Any" != shown


def test_a_misspelled_name_is_an_error(tmp_path):
    """The check above can fail: a name st_ext does not export is an error, not ``Any``."""
    output = run_mypy(
        "from st_ext import SentenceTransformerr\nfrom st_ext.losses import MatryoshkaLos\n",
        tmp_path,
        SKIPPING_UPSTREAM,
        tmp_path / "cache",
    )
    assert error_lines(output) == [1, 2], output


def test_upstream_top_level_names_are_all_listed():
    """The names the type checker reads (st_ext/__init__.py) cover upstream's top level on this release."""
    assert set(sentence_transformers.__all__) <= set(st_ext._SOURCES)


def test_each_mistake_is_reported_at_its_line_and_nowhere_else(tmp_path, following_cache):
    if not ON_6X:
        pytest.skip(NOT_ON_4X_REASON.format(installed=_compat.ST_VERSION))
    script = "\n".join(mistaken or correct for correct, mistaken in MISTAKES) + "\n"
    output = run_mypy(script, tmp_path, FOLLOWING_UPSTREAM, following_cache)
    mistaken_lines = [number for number, (_, mistaken) in enumerate(MISTAKES, start=1) if mistaken]
    assert error_lines(output) == mistaken_lines, "\n".join(output)


def correct_script_with_reveals() -> tuple[str, list[tuple[str, str]]]:
    """The training script without mistakes, then pairs of ``reveal_type``s whose types must be equal: each
    method st_ext's classes inherit, on st_ext's object and on upstream's."""
    lines = [correct for correct, _ in MISTAKES]
    lines += [
        "import sentence_transformers",
        "import st_ext",
        'upstream_model = sentence_transformers.SentenceTransformer("tiny")',
        "upstream_reranker = sentence_transformers.CrossEncoder('tiny')",
        "upstream_trainer = sentence_transformers.SentenceTransformerTrainer(model=upstream_model)",
        "cross_trainer = st_ext.CrossEncoderTrainer(model=reranker)",
        "upstream_cross_trainer = sentence_transformers.CrossEncoderTrainer(model=upstream_reranker)",
    ]
    pairs = [
        ("model.encode", "upstream_model.encode"),
        ("model.similarity", "upstream_model.similarity"),
        ("model.encode(['a'])", "upstream_model.encode(['a'])"),
        ("trainer.train", "upstream_trainer.train"),
        ("cross_trainer.train", "upstream_cross_trainer.train"),
        ("trainer.evaluate", "upstream_trainer.evaluate"),
    ]
    for ours, theirs in pairs:
        lines += [f"reveal_type({ours})", f"reveal_type({theirs})"]
    return "\n".join(lines) + "\n", pairs


def parameters_a_call_takes(cls: type) -> list[tuple[str, bool]]:
    """(name, keyword-only) of each parameter a call of ``cls`` binds at run time, in order: where st_ext's
    constructor passes ``*args``/``**kwargs`` on, upstream's parameters, then st_ext's own keyword-only ones."""
    own = list(inspect.signature(cls.__init__).parameters.values())[1:]
    passes_on = any(parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD) for parameter in own)
    if passes_on:
        upstream = next(base for base in cls.__mro__ if base.__module__.startswith("sentence_transformers."))
        upstream_parameters = list(inspect.signature(upstream.__init__).parameters.values())[1:]
        names = {parameter.name for parameter in upstream_parameters}
        own = upstream_parameters + [
            parameter for parameter in own if parameter.kind is parameter.KEYWORD_ONLY and parameter.name not in names
        ]
    return [(parameter.name, parameter.kind is parameter.KEYWORD_ONLY) for parameter in own]


def parameters_shown(shown: str) -> list[tuple[str, bool]]:
    """(name, keyword-only) of each parameter after ``self`` in mypy's ``def (self: ..., a: int =, *, b: ...)``."""
    parameters, keyword_only, depth, start = [], False, 0, shown.index("(") + 1
    for index in range(start, len(shown)):
        char = shown[index]
        if char in "[(":
            depth += 1
        elif char in "])" and depth > 0:
            depth -= 1
        elif char in ",)" and depth == 0:
            part = shown[start:index].strip()
            start = index + 1
            if part == "*":
                keyword_only = True
            elif part:
                parameters.append((part.split(":")[0], keyword_only))
            if char == ")":
                break
    return parameters[1:]


def test_the_script_without_mistakes_is_clean_and_inherits_upstreams_types(tmp_path, following_cache):
    if not ON_6X:
        pytest.skip(NOT_ON_4X_REASON.format(installed=_compat.ST_VERSION))
    script, pairs = correct_script_with_reveals()
    classes = st_ext_classes()
    constructed = sorted(classes)
    script += "".join(
        f"reveal_type({'st_ext' if name in st_ext._SOURCES else 'losses'}.{name}.__init__)\n" for name in constructed
    )
    output = run_mypy(script, tmp_path, FOLLOWING_UPSTREAM, following_cache)
    errors = [line for line in output if ": error:" in line]
    assert not errors, "\n".join(output)
    shown = revealed(output)
    assert len(shown) == 2 * len(pairs) + len(constructed), "\n".join(output)
    for index, (ours, theirs) in enumerate(pairs):
        assert shown[2 * index] == shown[2 * index + 1], (ours, theirs, shown[2 * index], shown[2 * index + 1])
        assert shown[2 * index] != "Any", ours
    for name, shown_init in zip(constructed, shown[2 * len(pairs) :]):
        assert parameters_shown(shown_init) == parameters_a_call_takes(classes[name]), (name, shown_init)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_the_lint_step_runs_mypy_over_st_ext_at_the_newest_end():
    """CI's first step, ``make lint``, runs mypy in the 6.2.0 environment with no target but pyproject's
    ``[tool.mypy]`` files, st_ext: an error there fails CI, so none can come back."""
    recipe = subprocess.run(
        ["make", "--no-print-directory", "-n", "lint"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert ".venv/st6/bin/python -m mypy --cache-dir .mypy_cache" in recipe, recipe
