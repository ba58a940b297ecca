"""mypy's error count over st_ext may only go down: ``make lint`` fails when it rises above a committed ceiling.

``mypy st_ext`` (upstream followed, ``[tool.mypy]`` in pyproject.toml) is not yet clean on the 6.2.0 end. Until
it is, ``tools/mypy_ceiling.txt`` holds the count last reached: a change that adds an error fails the lint step,
and a change that removes some lowers the number in that file. At zero, ``make lint`` runs plain ``mypy`` and
this tool and its file go.

Usage (from the repository root, with the environment's Python that has mypy and upstream installed)::

    python tools/mypy_ratchet.py
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CEILING_FILE = ROOT / "tools" / "mypy_ceiling.txt"
#: mypy's incremental cache, git-ignored; a second run reads what the first one parsed.
CACHE_DIR = ".mypy_cache"

_FOUND = re.compile(r"^Found (\d+) errors? in \d+ files? \(checked \d+ source files?\)$", re.MULTILINE)
_CLEAN = re.compile(r"^Success: no issues found in \d+ source files?$", re.MULTILINE)


def error_count(mypy_output: str) -> int | None:
    """The count mypy's summary line states, or None when there is no summary (mypy crashed or was misused)."""
    found = _FOUND.search(mypy_output)
    if found:
        return int(found.group(1))
    return 0 if _CLEAN.search(mypy_output) else None


def verdict(count: int, ceiling: int) -> tuple[bool, str]:
    """Whether the lint step passes, and the line it prints: the count, the ceiling and what to do."""
    if count > ceiling:
        return False, (
            f"mypy: {count} errors, above the ceiling of {ceiling} (tools/mypy_ceiling.txt): "
            f"fix the {count - ceiling} new ones listed above"
        )
    if count < ceiling:
        return True, (
            f"mypy: {count} errors, below the ceiling of {ceiling}: "
            f"write {count} into tools/mypy_ceiling.txt so that they cannot come back"
        )
    return True, f"mypy: {count} errors, at the ceiling of {ceiling} (tools/mypy_ceiling.txt)"


def main() -> int:
    ceiling = int(CEILING_FILE.read_text().strip())
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", CACHE_DIR],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    output = run.stdout + run.stderr
    count = error_count(output)
    if count is None:
        print(output, end="")
        print(f"mypy: no summary line (exit status {run.returncode}); see its output above")
        return 1
    passes, line = verdict(count, ceiling)
    if not passes:
        print(output, end="")
    print(line)
    return 0 if passes else 1


if __name__ == "__main__":
    sys.exit(main())
