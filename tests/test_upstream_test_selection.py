"""tools/upstream_test_selection.py on a tiny package: which tests a change to a method selects."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from upstream_test_selection import (  # noqa: E402  (a tool, not a package)
    _test_file_matches,
    callable_methods,
    changed_lines,
    changed_targets,
)

MODEL = """\
class Model:
    def supports(self, modality):
        return modality == "text"

    def enable(self, options=None):
        for module in self._modules_to_enable():
            module.enable(options)

    def _modules_to_enable(self):
        return []

    def former_enable(self, options=None):
        self.enable(options)
"""

TESTS = """\
from tiny_package.model import Model


def test_supports():
    assert Model().supports("text")


def test_enable():
    Model().enable()


def test_former_enable():
    Model().former_enable()
"""


def patch_changing(line: int) -> str:
    """A patch that rewrites ``line`` of tiny_package/model.py."""
    return (
        "diff --git a/tiny_package/model.py b/tiny_package/model.py\n"
        "--- a/tiny_package/model.py\n+++ b/tiny_package/model.py\n"
        f"@@ -{line},2 +{line},2 @@\n-old\n+new\n context\n"
    )


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "tiny_package").mkdir()
    (tmp_path / "tiny_package" / "__init__.py").write_text("")
    (tmp_path / "tiny_package" / "model.py").write_text(MODEL)
    (tmp_path / "test_model.py").write_text(TESTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def selected(tree: Path, line: int) -> list[str]:
    from tiny_package.model import Model

    targets = changed_targets(tree, patch_changing(line), "tiny_package")
    return [
        test.split("::")[1]
        for test in _test_file_matches(
            tree / "test_model.py",
            {target: Model for target in targets},
            callable_methods(targets, tree, "tiny_package"),
        )
    ]


def test_a_changed_method_selects_the_tests_that_call_it_or_its_callers(tree: Path) -> None:
    # line 6 is in `enable`: `test_supports` imports the class but never calls it
    assert selected(tree, 6) == ["test_enable", "test_former_enable"]


def test_a_changed_private_method_reaches_tests_through_its_callers(tree: Path) -> None:
    # line 10 is in `_modules_to_enable`, which only `enable` calls
    assert selected(tree, 10) == ["test_enable", "test_former_enable"]


def test_a_changed_method_selects_only_the_tests_that_call_it(tree: Path) -> None:
    # line 3 is in `supports`
    assert selected(tree, 3) == ["test_supports"]


def test_the_mail_signature_after_the_last_hunk_is_no_removed_line() -> None:
    patch = patch_changing(6) + "-- \n2.39.5\n"
    assert changed_lines(patch) == {"tiny_package/model.py": {6}}
