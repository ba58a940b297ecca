"""A type checker sees st_ext's classes where a training script imports them from st_ext.

mypy checks a script that imports every public name st_ext replaces (models, trainers, model card data, the
losses), upstream's names a swapped import needs (``util``, ``InputExample``, every upstream loss and module
class), and ``reveal_type``s each of st_ext's: mypy must name the class Python runs (its ``st_ext.`` path),
not ``Any``, and report no error. Upstream's packages are not followed (they are what they are, and reading
torch would take minutes); st_ext's modules are read without reporting their own errors.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
import sentence_transformers

import st_ext
from st_ext import _compat, losses

ROOT = Path(__file__).resolve().parents[1]
MYPY_CONFIG = """
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


def run_mypy(script: str, tmp_path: Path) -> list[str]:
    pytest.importorskip("mypy", reason="mypy is in requirements/test.txt")
    path = tmp_path / "train.py"
    path.write_text(script)
    config = tmp_path / "mypy.ini"
    config.write_text(MYPY_CONFIG.format(root=ROOT, cache=tmp_path / "mypy_cache"))
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(config), "--no-error-summary", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode in (0, 1), result.stderr
    return result.stdout.splitlines()


def test_a_training_script_sees_st_exts_classes(tmp_path):
    script, expected = user_script()
    output = run_mypy(script, tmp_path)
    errors = [line for line in output if ": error:" in line]
    assert not errors, "\n".join(errors)
    revealed = [re.search(r'Revealed type is "(.*)"', line).group(1) for line in output if "Revealed type" in line]
    assert len(revealed) == len(expected), output
    for qualified_name, shown in zip(expected, revealed):
        assert re.search(rf"(^|[ >\[]){re.escape(qualified_name)}($|\W)", shown), (qualified_name, shown)
        assert "Any" != shown


def test_a_misspelled_name_is_an_error(tmp_path):
    """The check above can fail: a name st_ext does not export is an error, not ``Any``."""
    output = run_mypy("from st_ext import SentenceTransformerr\nfrom st_ext.losses import MatryoshkaLos\n", tmp_path)
    assert len([line for line in output if ": error:" in line]) == 2, output


def test_upstream_top_level_names_are_all_listed():
    """The names the type checker reads (st_ext/__init__.py) cover upstream's top level on this release."""
    assert set(sentence_transformers.__all__) <= set(st_ext._SOURCES)
