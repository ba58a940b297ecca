"""Check every patch series in patches/ as a maintainer reviewing it would, and print one table.

For each series (a project at a released version), in a fresh tree made of the released sdist with the
upstream repository's tests/ and docs/ laid over it (from a clone of the repository, when one is given):

* applies: the patch applies with ``git am --keep-cr`` after the ones before it;
* own tests: the tests the patch adds or changes (a new test file whole, else its test functions), run before
  its code change (only its test files applied) in upstream's CI environment, and after it in each environment
  of the series: for sentence-transformers once without DeepSpeed (upstream's CI installs none) and once with
  it. A patch of a PR series must have tests, at least one of them must fail before it without DeepSpeed (where
  upstream's CI runs them), and none may fail after it;
* upstream tests: upstream's test files that exercise what the patch changes, found from what they import and
  call (``upstream_test_selection.py``), run in upstream's CI environment before and after the patch, with tiny
  locally built stand-ins for the Hub models of upstream's fixtures (``hub_stand_ins.py``) so that they run
  offline; the table counts the tests that truly ran (passed or failed, not skipped) and lists any test that
  passed before and fails after;
* lint: upstream's own linters on the files the patch touches (sentence-transformers: ruff check, ruff format
  and typos, as its pre-commit runs them; pytorch-metric-learning: black, isort, flake8).

Then the series is applied with ``git am`` to the repository's newest commit too (its default branch), and the
table says which patches apply there.

By hand (``make patches-check``): the sdists come from PyPI once (``.venv/sdists``), the repositories from
``--st-repo`` / ``--pml-repo`` (a path to a clone, bare or not, or a URL to clone); without a repository
the upstream-tests column says so. Tests run offline (``HF_HUB_OFFLINE=1``). The table is also written to
``runs/patches-check.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tests"))
from _upstream_source import sdist_path, unpack_sdist  # noqa: E402  (the tests' sdist cache and unpacking)
from upstream_test_selection import callable_methods, changed_targets, changed_tests  # noqa: E402

WORK = ROOT / ".venv" / "patch-trees"
REPORT = ROOT / "runs" / "patches-check.md"
#: The environment upstream's CI runs in: the series' environment without these packages.
NOT_IN_UPSTREAM_CI = ("deepspeed",)


@dataclass(frozen=True)
class Series:
    name: str
    project: str
    version: str
    python: Path
    lint: str  # "ruff" or "black"
    repository_option: str
    package: str  # the package's folder in the tree, below ``src/`` for a src layout
    pull_requests: bool = True  # a PR series: every patch carries tests that fail before it
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
        "sentence_transformers",
    ),
    # A backport for users pinned to 4.x, without tests of its own: tests/test_upstream_patches.py checks it.
    Series(
        "sentence-transformers 4.1.0",
        "sentence-transformers",
        "4.1.0",
        ROOT / ".venv/st4/bin/python",
        "ruff",
        "st_repo",
        "sentence_transformers",
        pull_requests=False,
    ),
    Series(
        "pytorch-metric-learning 2.9.0",
        "pytorch-metric-learning",
        "2.9.0",
        ROOT / ".venv/st6/bin/python",
        "black",
        "pml_repo",
        "pytorch_metric_learning",
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


def environments(series: Series) -> dict[str, Path]:
    """``{name: python}``: upstream's CI environment first (the series' one without NOT_IN_UPSTREAM_CI), then the
    series' own where it has any of those packages."""
    missing = run([str(series.python), "-c", "import deepspeed"], ROOT, check=False).returncode != 0
    if missing:
        return {"upstream CI": series.python}
    return {"without DeepSpeed": environment_without(series.python), "with DeepSpeed": series.python}


def environment_without(python: Path) -> Path:
    """A virtual environment with ``python``'s packages but NOT_IN_UPSTREAM_CI: its site-packages link to theirs."""
    name = python.parents[1].name + "-without-" + "-".join(NOT_IN_UPSTREAM_CI)
    destination = WORK.parent / name
    if not (destination / ".ready").exists():
        shutil.rmtree(destination, ignore_errors=True)
        run([str(python), "-m", "venv", "--without-pip", str(destination)], ROOT)
        source = Path(
            run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], ROOT).stdout.strip()
        )
        target = Path(
            run(
                [str(destination / "bin/python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                ROOT,
            ).stdout.strip()
        )
        excluded = re.compile(rf"^({'|'.join(NOT_IN_UPSTREAM_CI)})([-_.].*)?$", re.IGNORECASE)
        for entry in source.iterdir():
            if not excluded.match(entry.name) and not (target / entry.name).exists():
                (target / entry.name).symlink_to(entry)
        (destination / ".ready").touch()
    return destination / "bin" / "python"


def overlay(tree: Path, git_dir: Path, series: Series) -> str:
    """Lay the repository's tests and docs at the release's tag (else its HEAD) over the sdist's tree."""
    tag = TAGS[series.project].format(version=series.version)
    ref = tag if has_ref(git_dir, tag) else "HEAD"
    for path in series.overlay:
        archive = subprocess.run(["git", "--git-dir", str(git_dir), "archive", ref, path], capture_output=True)
        if archive.returncode == 0:
            subprocess.run(["tar", "x", "-C", str(tree)], input=archive.stdout, check=True)
    described = run(
        ["git", "--git-dir", str(git_dir), "describe", "--tags", "--always", ref], ROOT, check=False
    ).stdout.strip()
    return f"{ref} ({described})" if ref == "HEAD" else ref


def has_ref(git_dir: Path, ref: str) -> bool:
    return (
        run(["git", "--git-dir", str(git_dir), "rev-parse", "--verify", "--quiet", ref], ROOT, check=False).returncode
        == 0
    )


GIT_IDENTITY = ["-c", "user.name=patches-check", "-c", "user.email=patches-check@localhost"]


def commit_all(tree: Path, message: str) -> None:
    for command in (
        ["git", "init", "-q"],
        ["git", "config", "core.autocrlf", "false"],
        ["git", "add", "-A"],
        ["git", *GIT_IDENTITY, "commit", "-qm", message],
    ):
        run(command, tree)


def fresh_tree(series: Series, git_dir: Path | None) -> tuple[Path, str]:
    destination = WORK / series.name.replace(" ", "-")
    shutil.rmtree(destination, ignore_errors=True)
    destination.mkdir(parents=True)
    tree = unpack_sdist(sdist_path(series.project, series.version), destination)
    source = overlay(tree, git_dir, series) if git_dir is not None else "none"
    commit_all(tree, f"{series.name} with upstream's tests and docs")
    return tree, source


def touched(patch: Path) -> list[str]:
    return re.findall(r"^diff --git a/(\S+) b/", patch.read_text(errors="replace"), flags=re.MULTILINE)


def source_root(tree: Path) -> Path:
    return tree / "src" if (tree / "src").is_dir() else tree


def upstream_tests_for(series: Series, python: Path, tree: Path, patch: Path, own: list[str]) -> list[str]:
    """Upstream's test files that import or call what ``patch`` changes, in the tree with the patch applied."""
    root = source_root(tree)
    prefix = "src/" if root != tree else ""
    targets = changed_targets(root, patch.read_text(errors="replace"), series.package, prefix)
    if not targets:
        return []
    request = tree.parent / f"{patch.stem[:4]}-selection.json"
    answer = tree.parent / f"{patch.stem[:4]}-selected.json"
    request.write_text(
        json.dumps(
            {
                "targets": sorted(([t.module, t.name, t.method] for t in targets), key=str),
                "callable_methods": sorted(callable_methods(targets, root, series.package)),
            }
        )
    )
    candidates = sorted(str(path.relative_to(tree)) for path in (tree / "tests").rglob("test_*.py"))
    candidates = [file for file in candidates if file not in own]
    env = {**os.environ, **series.environment, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1"}
    command = [str(python), str(TOOLS / "upstream_test_selection.py"), str(request), str(answer), *candidates]
    run(command, tree, env=env)
    # The patch's own tests name what it changes too; they are counted as its own, and do not exist before it.
    selected = (test for tests in json.loads(answer.read_text()).values() for test in tests)
    return sorted(test for test in selected if test not in own)


def hub_cache(series: Series, python: Path) -> Path:
    """A Hub cache folder with the stand-ins built by ``python``'s packages (once per series)."""
    cache = WORK / f"hub-{series.name.replace(' ', '-')}"
    run([str(python), str(TOOLS / "hub_stand_ins.py"), str(cache)], ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return cache


def pytest_outcomes(
    series: Series,
    python: Path,
    tree: Path,
    files: list[str],
    tag: str,
    cache: Path | None = None,
    options: list[str] | None = None,
) -> dict[str, str]:
    """``{test id: "passed" | "failed" | "skipped"}`` for ``files``, run with the tree's package first on the path."""
    if not files:
        return {}
    report = tree.parent / f"{tag}.xml"
    report.unlink(missing_ok=True)
    env = {**os.environ, **series.environment, "PYTHONPATH": str(source_root(tree)), "HF_HUB_OFFLINE": "1"}
    if cache is not None:
        env["HF_HUB_CACHE"] = str(cache)
    command = [
        str(python),
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={report}",
        *(options or []),
        *files,
    ]
    subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
    if not report.exists():
        return {file: "failed" for file in files}
    outcomes = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcomes[name] = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
    return outcomes


def tally(outcomes: dict[str, str]) -> dict[str, int]:
    return {kind: sum(value == kind for value in outcomes.values()) for kind in ("passed", "failed", "skipped")}


def count(outcomes: dict[str, str]) -> str:
    numbers = tally(outcomes)
    return f"{numbers['passed']} passed, {numbers['failed']} failed" + (
        f", {numbers['skipped']} skipped" if numbers["skipped"] else ""
    )


def ran(outcomes: dict[str, str]) -> str:
    """How many tests truly ran (not skipped), and how many of them passed."""
    numbers = tally(outcomes)
    return f"{numbers['passed'] + numbers['failed']} ran ({numbers['passed']} passed)"


def lint_findings(series: Series, tree: Path, files: list[str]) -> dict[str, int]:
    """Upstream's linters on ``files`` as they are in the tree: findings per linter (lines it reports)."""
    present = [file for file in files if (tree / file).exists()]
    python_files = [file for file in present if file.endswith(".py")]
    tools = Path(sys.executable).parent
    if series.lint == "ruff":
        commands = {
            "ruff check": [str(tools / "ruff"), "check", "--no-fix", "--output-format", "concise", *python_files],
            "ruff format": [str(tools / "ruff"), "format", "--check", *python_files],
            "typos": [str(tools / "typos"), "--format", "brief", "--force-exclude", *present],
        }
    else:
        commands = {
            "black": [str(tools / "black"), "--check", *python_files],
            "isort": [str(tools / "isort"), "--profile", "black", "--check-only", *python_files],
            "flake8": [str(tools / "flake8"), *python_files],
        }
    findings = {}
    for name, command in commands.items():
        if (name != "typos" and not python_files) or not present:
            continue
        result = run(command, tree, check=False)
        lines = [line for line in (result.stdout + result.stderr).splitlines() if re.search(r"\.\w+\b", line)]
        findings[name] = len(lines) if result.returncode else 0
    return findings


def lint_cell(before: dict[str, int], after: dict[str, int]) -> str:
    """ "clean", or the findings after against those the same files had before the patch."""
    if not after:
        return "nothing to lint"
    if not any(after.values()):
        return "clean"
    new = {name: count for name, count in after.items() if count > before.get(name, 0)}
    shown = ", ".join(f"{name} {before.get(name, 0)} → {count}" for name, count in after.items() if count)
    return ("new findings: " if new else "no new findings (") + shown + ("" if new else ", as released)")


@dataclass
class PatchResult:
    series: str
    patch: str
    applies: bool = False
    own: dict[str, tuple[dict | None, dict]] = field(default_factory=dict)  # environment: (before, after)
    upstream: tuple[list[str], dict, dict] | None = None  # files, before, after
    lint: str = ""
    problems: list[str] = field(default_factory=list)


def check_patch(
    series: Series, envs: dict[str, Path], tree: Path, patch: Path, git_dir: Path | None, cache: Path
) -> PatchResult:
    result = PatchResult(series.name, patch.name[:4])
    ci_name, ci_python = next(iter(envs.items()))
    files = touched(patch)
    # Its tests on the code before it: only its test files applied.
    run(["git", "apply", "--include=tests/*", str(patch)], tree)
    own = changed_tests(tree, patch.read_text(errors="replace"))
    # Before it, in upstream's CI environment only: that is where they must fail.
    before = pytest_outcomes(series, ci_python, tree, own, f"{patch.stem[:4]}-own-before", cache)
    run(["git", "checkout", "-q", "--", "."], tree)
    run(["git", "clean", "-qfd"], tree)
    lint_before = lint_findings(series, tree, files)
    applied = run(["git", *GIT_IDENTITY, "am", "--keep-cr", "-q", str(patch)], tree, check=False)
    if applied.returncode != 0:
        run(["git", "am", "--abort"], tree, check=False)
        result.problems.append("does not apply")
        return result
    result.applies = True
    for i, (name, python) in enumerate(envs.items()):
        after = pytest_outcomes(series, python, tree, own, f"{patch.stem[:4]}-own-after-{i}", cache)
        result.own[name] = (before if name == ci_name else None, after)
        if tally(after)["failed"]:
            result.problems.append(f"its tests fail after it ({name})")
    if series.pull_requests:
        if not own:
            result.problems.append("no tests of its own")
        elif not tally(before)["failed"]:
            result.problems.append(f"its tests pass before it ({ci_name}): they prove no fix")
    if git_dir is not None:
        upstream = upstream_tests_for(series, ci_python, tree, patch, own)
        # Upstream's tests in a file the patch extends are upstream's; the patch's own are counted above.
        deselected = [option for node in own if "::" in node for option in ("--deselect", node)]
        # Before: the tree without this patch (upstream's tests in it are the same).
        run(["git", "checkout", "-q", "HEAD~1"], tree)
        old = pytest_outcomes(
            series, ci_python, tree, upstream, f"{patch.stem[:4]}-upstream-before", cache, deselected
        )
        run(["git", "checkout", "-q", "-"], tree)
        new = pytest_outcomes(series, ci_python, tree, upstream, f"{patch.stem[:4]}-upstream-after", cache, deselected)
        result.upstream = (upstream, old, new)
        broken = sorted(name for name, value in old.items() if value == "passed" and new.get(name) != "passed")
        if broken:
            result.problems.append("newly failing upstream tests: " + ", ".join(broken))
    lint_after = lint_findings(series, tree, files)
    result.lint = lint_cell(lint_before, lint_after)
    if result.lint.startswith("new findings"):
        result.problems.append("new lint findings")
    return result


def applies_on_newest(series: Series, git_dir: Path) -> tuple[str, dict[str, bool]]:
    """Apply the series with ``git am`` (LF, as in the repository) on the repository's newest commit."""
    tree = WORK / f"newest-{series.project}"
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    # Only the folders the patches touch: a partial clone may lack the blobs of others.
    folders = sorted({path.split("/")[0] for patch in series.patches for path in touched(patch)})
    archive = subprocess.run(
        ["git", "--git-dir", str(git_dir), "archive", "HEAD", *folders], capture_output=True, check=True
    )
    subprocess.run(["tar", "x", "-C", str(tree)], input=archive.stdout, check=True)
    commit_all(tree, "newest")
    described = run(["git", "--git-dir", str(git_dir), "log", "-1", "--format=%h %cs"], ROOT).stdout.strip()
    applied = {}
    for patch in series.patches:
        result = run(["git", *GIT_IDENTITY, "am", "-3", "-q", str(patch)], tree, check=False)
        applied[patch.name[:4]] = result.returncode == 0
        if result.returncode != 0:
            run(["git", "am", "--abort"], tree, check=False)
    shutil.rmtree(tree, ignore_errors=True)
    return described, applied


def check_series(
    series: Series, repository: str | None, only: list[str] | None, report: Callable[[list[PatchResult]], None]
) -> tuple[list[PatchResult], str]:
    """The series' results, passed to ``report`` after each patch too, and a note on what it was checked against."""
    git_dir = git_dir_of(repository, series.project) if repository else None
    tree, source = fresh_tree(series, git_dir)
    envs = environments(series)
    cache = hub_cache(series, next(iter(envs.values())))
    results = []
    for patch in series.patches:
        if only and patch.name[:4] not in only:
            run(["git", *GIT_IDENTITY, "am", "--keep-cr", "-q", str(patch)], tree)
            continue
        results.append(check_patch(series, envs, tree, patch, git_dir, cache))
        report(results)
        if not results[-1].applies:
            break
    note = f"{series.name}: upstream tests and docs from {source}; environments: {', '.join(envs)}"
    if git_dir is not None and series.pull_requests:
        described, applied = applies_on_newest(series, git_dir)
        note += f"; on the repository's newest commit ({described}) " + ", ".join(
            f"{name} {'applies' if ok else 'does not apply'}" for name, ok in applied.items()
        )
    return results, note


def row(result: PatchResult) -> list[str]:
    own = "; ".join(
        f"{name}: " + (f"before {count(before)}, " if before is not None else "") + f"after {count(after)}"
        for name, (before, after) in result.own.items()
    ) or ("none" if result.applies else "")
    if result.upstream is None:
        upstream = "no repository given" if result.applies else ""
    elif not result.upstream[0]:
        upstream = "none import or call what it changes"
    else:
        files, old, new = result.upstream
        upstream = f"{len({test.split('::')[0] for test in files})} files: {ran(old)} → {ran(new)}"
    verdict = "ok" if not result.problems else "; ".join(result.problems)
    return [result.series, result.patch, "yes" if result.applies else "no", own, upstream, result.lint, verdict]


def write_report(results: list[PatchResult], notes: list[str]) -> str:
    header = [
        "series",
        "patch",
        "applies",
        "its own tests",
        "upstream tests that exercise it: ran before → after",
        "upstream's lint",
        "verdict",
    ]
    table = "\n".join(
        ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        + ["| " + " | ".join(row(result)) + " |" for result in results]
        + [""]
        + [f"- {note}" for note in notes]
    )
    REPORT.parent.mkdir(exist_ok=True)
    REPORT.write_text(table + "\n")
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--st-repo", default="https://github.com/huggingface/sentence-transformers")
    parser.add_argument("--pml-repo", default="https://github.com/KevinMusgrave/pytorch-metric-learning")
    parser.add_argument("--series", nargs="*", help="names of series to check (default: all)")
    parser.add_argument("--patches", nargs="*", help="numbers of the patches to check, e.g. 0003 (default: all)")
    args = parser.parse_args()
    results: list[PatchResult] = []
    notes: list[str] = []
    for series in SERIES:
        if args.series and series.name not in args.series:
            continue
        # The report so far is written after each patch, so that a long run shows where it is.
        checked, note = check_series(
            series,
            getattr(args, series.repository_option),
            args.patches,
            lambda partial: write_report(results + partial, notes),
        )
        results += checked
        notes.append(note)
    print(write_report(results, notes))
    return 0 if all(not result.problems for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
