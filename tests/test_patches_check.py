"""tools/patches_check.py on a tiny synthetic project: the rules a patch's own tests and upstream's tests must meet.

Each test builds a released tree (a package ``pkg`` with a bug: ``add`` subtracts) and a patch made with
``git format-patch``, then runs the checker on them with this interpreter, offline, in a few seconds. The last test
checks a Hub stand-in (``tools/hub_stand_ins.py``) without which upstream's tests of a changed loss would not run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sentence_transformers import CrossEncoder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import hub_stand_ins  # noqa: E402  (a tool, not a package)
import patches_check  # noqa: E402
from patches_check import Series, check_patch, pytest_outcomes, ran  # noqa: E402

RELEASED = {
    "pkg/__init__.py": """\
import math


def add(a, b):
    return a - b


def root(value):
    return math.sqrt(value)


def check(value):
    if value < 0:
        raise ValueError("negative")
    return value
""",
    "pyproject.toml": """\
[tool.pytest.ini_options]
addopts = "-m 'not slow'"
markers = ["slow: marks tests as slow"]
""",
    "tests/__init__.py": "",
}
FIXED = RELEASED["pkg/__init__.py"].replace("return a - b", "return a + b")
GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]

SERIES = Series(
    "tiny 1.0",
    "tiny",
    "1.0",
    Path(sys.executable),
    "black",
    "tiny_repo",
    "pkg",
    environment={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
)


@pytest.fixture(autouse=True)
def no_lint(monkeypatch: pytest.MonkeyPatch) -> None:
    """Upstream's linters are not what these tests check, nor installed here."""
    monkeypatch.setattr(patches_check, "lint_findings", lambda series, tree, files: {})


def git(tree: Path, *arguments: str) -> str:
    return subprocess.run([*GIT, *arguments], cwd=tree, check=True, capture_output=True, text=True).stdout


def write(tree: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(text)


def released_tree_and_patch(
    tmp_path: Path, changes: dict[str, str], released: dict[str, str] = RELEASED
) -> tuple[Path, Path]:
    """The released tree, committed, and the ``git format-patch`` of ``changes`` made on it."""
    tree = tmp_path / "tree"
    tree.mkdir()
    write(tree, released)
    git(tree, "init", "-q")
    git(tree, "add", "-A")
    git(tree, "commit", "-qm", "released")
    write(tree, changes)
    git(tree, "add", "-A")
    git(tree, "commit", "-qm", "the fix")
    patch = Path(git(tree, "format-patch", "-1", "HEAD", "-o", str(tmp_path / "patches")).strip())
    git(tree, "reset", "-q", "--hard", "HEAD~1")
    return tree, patch


def problems(
    tmp_path: Path,
    changes: dict[str, str],
    environments: tuple[str, ...] = ("upstream CI",),
    released: dict[str, str] = RELEASED,
) -> list[str]:
    tree, patch = released_tree_and_patch(tmp_path, changes, released)
    envs = {name: Path(sys.executable) for name in environments}
    return check_patch(SERIES, envs, tree, patch, None, tmp_path / "hub").problems


def test_a_fix_whose_test_fails_on_an_assertion_before_it_is_ok(tmp_path: Path) -> None:
    test = "from pkg import add\n\n\ndef test_add():\n    assert add(1, 2) == 3\n"
    assert problems(tmp_path, {"pkg/__init__.py": FIXED, "tests/test_add.py": test}) == []


def test_a_test_failing_before_only_on_an_import_proves_nothing(tmp_path: Path) -> None:
    """Its test imports a name the patch adds and checks what the released code already does: it fails before
    the patch on the import alone."""
    code = FIXED + "\n\nTOLERANCE = 0\n"
    test = "from pkg import TOLERANCE, add\n\n\ndef test_add_zero():\n    assert add(1, TOLERANCE) == 1\n"
    found = problems(tmp_path, {"pkg/__init__.py": code, "tests/test_add.py": test})
    assert len(found) == 1 and "without proving the fix" in found[0] and "fails on an import" in found[0]


def test_a_test_erroring_at_setup_before_proves_nothing(tmp_path: Path) -> None:
    test = """\
import pytest

from pkg import add


@pytest.fixture
def three():
    if add(1, 2) != 3:
        raise RuntimeError("no fixture")
    return 3


def test_three(three):
    assert three == 3
"""
    found = problems(tmp_path, {"pkg/__init__.py": FIXED, "tests/test_add.py": test})
    assert len(found) == 1 and "errors at setup" in found[0]


def test_a_failure_raised_by_a_library_in_code_the_patch_leaves_proves_nothing(tmp_path: Path) -> None:
    """``math.sqrt``, called by ``root``, which the patch does not change, raises on the released ``add``'s result:
    the test asserts nothing of the fix (as a test that fails on an input it built wrongly)."""
    test = "from pkg import add, root\n\n\ndef test_add():\n    root(add(1, 2))\n"
    found = problems(tmp_path, {"pkg/__init__.py": FIXED, "tests/test_add.py": test})
    assert len(found) == 1 and "fails on ValueError raised outside what the patch changes" in found[0]


def test_an_error_the_package_raises_itself_proves_the_fix(tmp_path: Path) -> None:
    """``check``, which the patch does not change, raises its own error on the released ``add``'s result: the
    behaviour the fix removes."""
    test = "from pkg import add, check\n\n\ndef test_add():\n    check(add(1, 2))\n"
    assert problems(tmp_path, {"pkg/__init__.py": FIXED, "tests/test_add.py": test}) == []


def test_the_error_the_fix_removes_proves_it(tmp_path: Path) -> None:
    """The released ``add`` raises a TypeError on the line the patch changes."""
    released = {**RELEASED, "pkg/__init__.py": RELEASED["pkg/__init__.py"].replace("return a - b", 'return a + ""')}
    test = "from pkg import add\n\n\ndef test_add():\n    assert add(1, 2) == 3\n"
    assert problems(tmp_path, {"pkg/__init__.py": FIXED, "tests/test_add.py": test}, released=released) == []


def test_the_pass_with_deepspeed_runs_the_slow_tests(tmp_path: Path) -> None:
    """A slow test that fails after the patch: upstream's CI deselects it, the pass with DeepSpeed runs it."""
    test = """\
import pytest

from pkg import add


def test_add():
    assert add(1, 2) == 3


@pytest.mark.slow
def test_add_large():
    assert add(10**6, 1) == 10**6
"""
    found = problems(
        tmp_path, {"pkg/__init__.py": FIXED, "tests/test_add.py": test}, ("without DeepSpeed", "with DeepSpeed")
    )
    assert found == ["its tests fail after it (with DeepSpeed)"]


def test_a_documentation_patch_states_what_its_tests_show(tmp_path: Path) -> None:
    """A patch that changes no code: its tests pass before it, and that is what it needs."""
    test = "from pkg import check\n\n\ndef test_check_keeps_zero():\n    assert check(0) == 0\n"
    assert problems(tmp_path, {"docs/check.md": "`check(0)` is 0.\n", "tests/test_check.py": test}) == []


def test_a_test_erroring_at_setup_did_not_run(tmp_path: Path) -> None:
    """A test whose fixture fails (e.g. a Hub model without a stand-in) is not counted as run."""
    tree = tmp_path / "tree"
    write(
        tree,
        {
            **RELEASED,
            "tests/test_model.py": """\
import pytest


@pytest.fixture
def model():
    raise OSError("no stand-in for this Hub model")


def test_model(model):
    assert model
""",
        },
    )
    outcomes = pytest_outcomes(SERIES, Path(sys.executable), tree, ["tests/test_model.py"], "setup")
    assert ran(outcomes) == "0 ran (0 passed)"


@pytest.mark.parametrize("kind", ["failure", "pass"])
def test_a_test_failing_in_its_run_did_run(tmp_path: Path, kind: str) -> None:
    tree = tmp_path / "tree"
    body = "assert False" if kind == "failure" else "assert True"
    write(tree, {**RELEASED, "tests/test_run.py": f"def test_run():\n    {body}\n"})
    outcomes = pytest_outcomes(SERIES, Path(sys.executable), tree, ["tests/test_run.py"], "run")
    assert ran(outcomes) == ("1 ran (0 passed)" if kind == "failure" else "1 ran (1 passed)")


def test_a_tree_without_a_pytest_configuration_runs_without_the_one_above_it(tmp_path: Path) -> None:
    """pytorch-metric-learning's sdist has no pytest configuration: its tests must not run under the one of a folder
    above it (this project's), whose options would apply and whose folder would prefix the tests' names."""
    write(tmp_path, {"pyproject.toml": '[tool.pytest.ini_options]\naddopts = "-k not_this_one"\n'})
    tree = tmp_path / "tree"
    released = {name: text for name, text in RELEASED.items() if name != "pyproject.toml"}
    write(tree, {**released, "tests/test_run.py": "def test_run():\n    assert True\n"})
    outcomes = pytest_outcomes(SERIES, Path(sys.executable), tree, ["tests/test_run.py"], "run")
    assert list(outcomes) == ["tests.test_run::test_run"]
    assert outcomes["tests.test_run::test_run"].kind == "passed"


def test_the_environment_without_deepspeed_follows_a_change_of_its_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A package installed in the series' environment after its copy without DeepSpeed was made reaches the copy."""
    monkeypatch.setattr(patches_check, "WORK", tmp_path / "trees")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "source")], check=True)
    python = tmp_path / "source" / "bin" / "python"
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout.strip())
    (site / "deepspeed").mkdir()
    (site / "first.py").write_text("")
    copy = patches_check.environment_without(python)
    (site / "second.py").write_text("")
    os.utime(site, (time.time() + 5, time.time() + 5))  # the install comes after the copy, whatever the clock's step
    copy = patches_check.environment_without(python)
    copied = Path(subprocess.run([str(copy), "-c", code], check=True, capture_output=True, text=True).stdout.strip())
    assert sorted(entry.name for entry in copied.iterdir()) == ["first.py", "second.py"]


def test_the_modular_reranker_fixture_has_a_stand_in(tmp_path: Path) -> None:
    """The cross-encoder's cached MNRL tests load ``reranker-bert-tiny-gooaq-bce-STv54``: without its stand-in they
    error at setup before and after a patch that changes that loss, and are not counted as run."""
    hub_stand_ins.STAND_INS["cross-encoder-testing/reranker-bert-tiny-gooaq-bce-STv54"](tmp_path / "reranker")
    model = CrossEncoder(str(tmp_path / "reranker"), device="cpu")
    scores = model.predict([("a man plays the guitar", "a man plays music"), ("a dog", "a car")])
    assert scores.shape == (2,)
