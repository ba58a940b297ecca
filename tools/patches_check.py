"""Check every patch series in patches/ as a maintainer reviewing it would, and print one table.

For each series (a project at a released version), in a fresh tree made of the released sdist with the
upstream repository's tests/ and docs/ laid over it (from a clone of the repository, when one is given):

* applies: the patch applies with ``git am --keep-cr`` after the ones before it;
* own tests: the test files the patch adds or changes, run before its code change (only its test files
  applied) and after it: they should fail before and pass after;
* upstream tests: upstream's test files for the source files the patch touches (``test_<module>.py``),
  run on the unpatched tree and after the patch; any test that passed before and fails after is listed;
* lint: upstream's own linters on the files the patch touches (sentence-transformers: ruff check and
  ruff format, with the tree's pyproject.toml; pytorch-metric-learning: black, isort, flake8).

By hand (``make patches-check``): the sdists come from PyPI once (``.venv/sdists``), the repositories from
``--st-repo`` / ``--pml-repo`` (a path to a clone, bare or not, or a URL to clone); without a repository
the upstream-tests column says so. Tests run offline (``HF_HUB_OFFLINE=1``): upstream tests that download
from the Hub fail alike before and after, and only the difference counts. The table is also written to
``runs/patches-check.md``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from _upstream_source import sdist_path, unpack_sdist  # noqa: E402  (the tests' sdist cache and unpacking)

WORK = ROOT / ".venv" / "patch-trees"
REPORT = ROOT / "runs" / "patches-check.md"


@dataclass(frozen=True)
class Series:
    name: str
    project: str
    version: str
    python: Path
    lint: str  # "ruff" or "black"
    repository_option: str
    overlay: tuple[str, ...] = ("tests", "docs")
    environment: dict = field(default_factory=dict)

    @property
    def patches(self) -> list[Path]:
        return sorted((ROOT / "patches" / self.project / self.version).glob("*.patch"))


SERIES = [
    Series(
        "sentence-transformers 6.2.0",
        "sentence-transformers",
        "6.2.0",
        ROOT / ".venv/st6/bin/python",
        "ruff",
        "st_repo",
    ),
    Series(
        "sentence-transformers 4.1.0",
        "sentence-transformers",
        "4.1.0",
        ROOT / ".venv/st4/bin/python",
        "ruff",
        "st_repo",
    ),
    Series(
        "pytorch-metric-learning 2.9.0",
        "pytorch-metric-learning",
        "2.9.0",
        ROOT / ".venv/st6/bin/python",
        "black",
        "pml_repo",
        overlay=("tests", "docs", ".flake8"),
        environment={"TEST_DEVICE": "cpu", "TEST_DTYPES": "float32,float64"},
    ),
]
#: The tag of each release in its repository; where the repository has no such tag, its default branch.
TAGS = {"sentence-transformers": "v{version}", "pytorch-metric-learning": "v{version}"}


def run(command: list[str], cwd: Path, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed in {cwd}:\n{result.stdout}\n{result.stderr}")
    return result


def git_dir_of(repository: str, project: str) -> Path:
    """A git directory for ``repository``: the given clone, or a bare clone made under .venv."""
    path = Path(repository)
    if path.exists():
        return path if (path / "HEAD").exists() and not (path / ".git").exists() else path / ".git"
    clone = ROOT / ".venv" / "upstream" / f"{project}.git"
    if not clone.exists():
        run(["git", "clone", "--bare", "--quiet", repository, str(clone)], ROOT)
    return clone


def overlay(tree: Path, git_dir: Path, series: Series) -> str:
    """Lay the repository's tests and docs at the release's tag (else its HEAD) over the sdist's tree."""
    tag = TAGS[series.project].format(version=series.version)
    ref = (
        tag
        if run(
            ["git", "--git-dir", str(git_dir), "rev-parse", "--verify", "--quiet", tag], ROOT, check=False
        ).returncode
        == 0
        else "HEAD"
    )
    for path in series.overlay:
        archive = subprocess.run(["git", "--git-dir", str(git_dir), "archive", ref, path], capture_output=True)
        if archive.returncode == 0:
            subprocess.run(["tar", "x", "-C", str(tree)], input=archive.stdout, check=True)
    described = run(
        ["git", "--git-dir", str(git_dir), "describe", "--tags", "--always", ref], ROOT, check=False
    ).stdout.strip()
    return f"{ref} ({described})" if ref == "HEAD" else ref


def fresh_tree(series: Series, git_dir: Path | None) -> tuple[Path, str]:
    destination = WORK / series.name.replace(" ", "-")
    shutil.rmtree(destination, ignore_errors=True)
    destination.mkdir(parents=True)
    tree = unpack_sdist(sdist_path(series.project, series.version), destination)
    source = overlay(tree, git_dir, series) if git_dir is not None else "none"
    for command in (
        ["git", "init", "-q"],
        ["git", "config", "core.autocrlf", "false"],
        ["git", "config", "user.name", "patches-check"],
        ["git", "config", "user.email", "patches-check@localhost"],
        ["git", "add", "-A"],
        ["git", "commit", "-qm", f"{series.name} with upstream's tests and docs"],
    ):
        run(command, tree)
    return tree, source


def touched(patch: Path) -> list[str]:
    return re.findall(r"^diff --git a/(\S+) b/", patch.read_text(errors="replace"), flags=re.MULTILINE)


def upstream_tests_for(tree: Path, sources: list[str]) -> list[str]:
    """Upstream's test files of the touched source files: ``test_<module>.py`` (also snake-cased)."""
    found = set()
    for source in sources:
        if source.startswith(("tests/", "docs/")) or not source.endswith(".py"):
            continue
        stem = Path(source).stem
        snake = re.sub(r"(?<!^)(?=[A-Z])", "_", stem).lower()
        for name in {f"test_{stem}.py", f"test_{snake}.py"}:
            found.update(str(path.relative_to(tree)) for path in (tree / "tests").rglob(name))
    return sorted(found)


def pytest_outcomes(series: Series, tree: Path, files: list[str], tag: str) -> dict[str, str]:
    """``{test id: "passed" | "failed" | "skipped"}`` for ``files``, run with the tree's package first on the path."""
    if not files:
        return {}
    report = tree.parent / f"{tag}.xml"
    package_root = tree / "src" if (tree / "src").is_dir() else tree
    env = {**os.environ, **series.environment, "PYTHONPATH": str(package_root), "HF_HUB_OFFLINE": "1"}
    command = [str(series.python), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *files]
    subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    if not report.exists():
        return {file: "failed" for file in files}
    outcomes = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcomes[name] = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
    return outcomes


def count(outcomes: dict[str, str]) -> str:
    passed = sum(value == "passed" for value in outcomes.values())
    failed = sum(value == "failed" for value in outcomes.values())
    skipped = sum(value == "skipped" for value in outcomes.values())
    return f"{passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else "")


def lint_findings(series: Series, tree: Path, files: list[str]) -> dict[str, int]:
    """Upstream's linters on ``files`` as they are in the tree: findings per linter (lines it reports)."""
    python_files = [file for file in files if file.endswith(".py") and (tree / file).exists()]
    if not python_files:
        return {}
    tools = Path(sys.executable).parent
    if series.lint == "ruff":
        commands = {
            "ruff check": [str(tools / "ruff"), "check", "--no-fix", "--output-format", "concise", *python_files],
            "ruff format": [str(tools / "ruff"), "format", "--check", *python_files],
        }
    else:
        commands = {
            "black": [str(tools / "black"), "--check", *python_files],
            "isort": [str(tools / "isort"), "--profile", "black", "--check-only", *python_files],
            "flake8": [str(tools / "flake8"), *python_files],
        }
    findings = {}
    for name, command in commands.items():
        result = run(command, tree, check=False)
        lines = [line for line in (result.stdout + result.stderr).splitlines() if re.search(r"\.py\b", line)]
        findings[name] = len(lines) if result.returncode else 0
    return findings


def lint_cell(before: dict[str, int], after: dict[str, int]) -> str:
    """ "clean", or the findings after against those the same files had before the patch."""
    if not after:
        return "no Python file"
    if not any(after.values()):
        return "clean"
    new = {name: count for name, count in after.items() if count > before.get(name, 0)}
    shown = ", ".join(f"{name} {before.get(name, 0)} → {count}" for name, count in after.items() if count)
    return ("new findings: " if new else "no new findings (") + shown + ("" if new else ", as released)")


def check_series(series: Series, repository: str | None) -> list[list[str]]:
    git_dir = git_dir_of(repository, series.project) if repository else None
    tree, source = fresh_tree(series, git_dir)
    rows = []
    baseline_upstream: dict[str, dict[str, str]] = {}
    for patch in series.patches:
        files = touched(patch)
        own = [file for file in files if file.startswith("tests/") and file.endswith(".py")]
        upstream = [file for file in upstream_tests_for(tree, files) if file not in own] if git_dir else []
        for file in upstream:
            if file not in baseline_upstream:
                baseline_upstream[file] = pytest_outcomes(series, tree, [file], "base-" + file.replace("/", "_"))
        # Its tests on the code before it: only its test files applied.
        run(["git", "apply", "--include=tests/*", str(patch)], tree)
        before = pytest_outcomes(series, tree, own, f"{patch.stem}-before")
        run(["git", "checkout", "-q", "--", "."], tree)
        run(["git", "clean", "-qfd"], tree)
        lint_before = lint_findings(series, tree, files)
        applied = run(["git", "am", "--keep-cr", "-q", str(patch)], tree, check=False)
        if applied.returncode != 0:
            run(["git", "am", "--abort"], tree, check=False)
            rows.append([series.name, patch.name[:4], "no", "", "", ""])
            break
        after = pytest_outcomes(series, tree, own, f"{patch.stem}-after")
        own_cell = f"before: {count(before)}; after: {count(after)}" if own else "none"
        if git_dir is None:
            upstream_cell = "no repository given"
        elif not upstream:
            upstream_cell = "none for these files"
        else:
            old = {name: value for file in upstream for name, value in baseline_upstream[file].items()}
            new = pytest_outcomes(series, tree, upstream, f"{patch.stem}-upstream")
            broken = sorted(name for name, value in old.items() if value == "passed" and new.get(name) != "passed")
            upstream_cell = f"{count(old)} → {count(new)}" + (
                f"; newly failing: {', '.join(broken)}" if broken else ""
            )
        lint_after = lint_findings(series, tree, files)
        rows.append([series.name, patch.name[:4], "yes", own_cell, upstream_cell, lint_cell(lint_before, lint_after)])
    print(f"{series.name}: upstream tests and docs from {source}", file=sys.stderr)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--st-repo", default="https://github.com/huggingface/sentence-transformers")
    parser.add_argument("--pml-repo", default="https://github.com/KevinMusgrave/pytorch-metric-learning")
    parser.add_argument("--series", nargs="*", help="names of series to check (default: all)")
    args = parser.parse_args()
    header = ["series", "patch", "applies", "its own tests", "upstream tests of the touched files", "upstream's lint"]
    rows = []
    for series in SERIES:
        if args.series and series.name not in args.series:
            continue
        rows += check_series(series, getattr(args, series.repository_option))
    table = "\n".join(
        ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        + ["| " + " | ".join(row) + " |" for row in rows]
    )
    print(table)
    REPORT.parent.mkdir(exist_ok=True)
    REPORT.write_text(table + "\n")
    # A patch passes when it applies, its own tests pass after it, it breaks no upstream test and it adds no lint
    # finding (a file it touches may have had findings as released).
    ok = all(
        row[2] == "yes"
        and not re.search(r"after: .*\b[1-9]\d* failed", row[3])
        and "newly failing" not in row[4]
        and not row[5].startswith("new findings")
        for row in rows
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
