"""The lint step's mypy ratchet: it reads mypy's summary line, fails above the committed ceiling, and fails when
mypy printed no summary (a crash is never read as a clean run)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("mypy_ratchet", ROOT / "tools" / "mypy_ratchet.py")
assert _spec is not None and _spec.loader is not None
mypy_ratchet = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mypy_ratchet)


@pytest.mark.parametrize(
    ("output", "count"),
    [
        ("st_ext/a.py:1: error: x  [misc]\nFound 291 errors in 39 files (checked 72 source files)\n", 291),
        ("st_ext/a.py:1: error: x  [misc]\nFound 1 error in 1 file (checked 72 source files)\n", 1),
        ("Success: no issues found in 72 source files\n", 0),
        ("Traceback (most recent call last):\n  ...\nKeyError: 'x'\n", None),
        ("mypy: error: Cannot find implementation or library stub for module named 'st_ext'\n", None),
    ],
)
def test_the_count_is_read_from_the_summary_line_only(output, count):
    assert mypy_ratchet.error_count(output) == count


def test_above_the_ceiling_fails_and_names_how_many_are_new():
    passes, line = mypy_ratchet.verdict(293, 291)
    assert not passes
    assert "293 errors" in line and "291" in line and "2 new" in line


def test_at_or_below_the_ceiling_passes_and_below_says_to_lower_it():
    assert mypy_ratchet.verdict(291, 291)[0]
    passes, line = mypy_ratchet.verdict(280, 291)
    assert passes and "write 280 into tools/mypy_ceiling.txt" in line


def test_the_ceiling_file_holds_one_count():
    assert mypy_ratchet.CEILING_FILE.read_text().strip().isdigit()


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_lint_runs_the_ratchet_in_the_newest_environment():
    recipe = subprocess.run(
        ["make", "--no-print-directory", "-n", "lint"], cwd=ROOT, capture_output=True, text=True
    ).stdout
    assert ".venv/st6/bin/python tools/mypy_ratchet.py" in recipe
