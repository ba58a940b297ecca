"""Check every patch series in patches/ as a maintainer reviewing it would, and print one table.

For each series (a project at a released version), in a fresh tree made of the released sdist with the
upstream repository's tests/, docs/ and skills/ laid over it (from a clone of the repository, when one is given):

* applies: the patch applies with ``git am --keep-cr`` after the ones before it;
* own tests: the tests the patch adds or changes (a new test file whole, else its test functions), run before
  its code change (only its test files applied) and after it in each environment of the series: for
  sentence-transformers once without DeepSpeed as upstream's CI runs them (no DeepSpeed, ``-m "not slow"``) and
  once with DeepSpeed and the patch's slow tests too (upstream marks every DeepSpeed test slow). A patch of a PR
  series must have tests and none may fail after it. Before it, without DeepSpeed, at least one must fail, and
  each one that fails must fail in the test's own run on an assertion or on the error the fix removes: an
  exception raised in code the patch changes, one the package raises itself, or a missing attribute the patch
  adds. A test that errors at setup,
  fails on an import, or fails on an exception raised outside what the patch changes (an artefact of the test
  file) proves nothing, and the table shows each failure's line. A test that passes before guards what must not
  change. A documentation patch (no change to the package) states what its tests show: they pass before and
  after it;
* upstream tests: upstream's test files that exercise what the patch changes, found from what they import and
  call (``upstream_test_selection.py``), run in upstream's CI environment before and after the patch, with tiny
  locally built stand-ins for the Hub models of upstream's fixtures (``hub_stand_ins.py``) so that they run
  offline; the table counts the tests that truly ran (passed or failed, not skipped, not errored at setup) and
  lists any test that passed before and fails after;
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
    #: The repository's folders laid over the sdist, which ships none of them: a patch may touch them too.
    overlay: tuple[str, ...] = ("tests", "docs", "skills")
    environment: dict = field(default_factory=dict)
    #: ``-m`` for the pass with DeepSpeed: the slow tests too (every DeepSpeed test is marked slow), not the
    #: ``custom`` ones, which load third-party models from the Hub.
    all_tests_marker: str = "not custom"

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
    """A virtual environment with ``python``'s packages but NOT_IN_UPSTREAM_CI: its site-packages link to theirs.

    It is made again whenever ``python``'s site-packages changed after it was made (a package installed, removed or
    upgraded there), as links made before would miss or dangle."""
    name = python.parents[1].name + "-without-" + "-".join(NOT_IN_UPSTREAM_CI)
    destination = WORK.parent / name
    source = Path(
        run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], ROOT).stdout.strip()
    )
    ready = destination / ".ready"
    if not ready.exists() or ready.stat().st_mtime < source.stat().st_mtime:
        shutil.rmtree(destination, ignore_errors=True)
        run([str(python), "-m", "venv", "--without-pip", str(destination)], ROOT)
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
        ready.touch()
    return destination / "bin" / "python"


def overlay(tree: Path, git_dir: Path, series: Series) -> str:
    """Lay the series' overlay folders of the repository at the release's tag (else its HEAD) over the sdist's tree."""
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


@dataclass(frozen=True)
class Outcome:
    """One test's result. ``kind``: "passed"; "failed" (in the test's own run); "error" (at its setup or teardown,
    or collecting its file: the test did not run); "skipped". A failure's ``exception`` (its type's name),
    ``message`` and ``frames`` (``(path, line, code)``, innermost last) are read from its native traceback."""

    kind: str
    exception: str = ""
    message: str = ""
    frames: tuple[tuple[str, int, str], ...] = ()


def parse_traceback(text: str) -> tuple[str, str, tuple[tuple[str, int, str], ...]]:
    """``(exception type, first line of its message, frames)`` of the last traceback in a native traceback text."""
    lines = (text or "").splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    lines = lines[starts[-1] :] if starts else lines
    frames, exception, message = [], "", ""
    for line in lines:
        frame = re.match(r'\s*File "(.+?)", line (\d+)', line)
        if frame:
            frames.append((frame.group(1), int(frame.group(2)), ""))
            exception = ""
        elif frames and not frames[-1][2] and line.strip() and line[0].isspace():  # the frame's line of code
            frames[-1] = (*frames[-1][:2], line.strip())
        elif frames and not exception and line and not line[0].isspace():
            name, _, message = line.partition(": ")
            exception = name.rsplit(".", 1)[-1]
    if not frames:  # pytest's own report, e.g. of an error collecting a test file: its "E   Error: ..." lines
        reported = re.search(r"^E\s+([\w.]+): ?(.*)$", "\n".join(lines), flags=re.MULTILINE)
        if reported:
            exception, message = reported.group(1).rsplit(".", 1)[-1], reported.group(2)
    return exception, message.strip(), tuple(frames)


def pytest_outcomes(
    series: Series,
    python: Path,
    tree: Path,
    files: list[str],
    tag: str,
    cache: Path | None = None,
    options: list[str] | None = None,
) -> dict[str, Outcome]:
    """``{test id: its Outcome}`` for ``files``, run with the tree's package first on the path."""
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
        "--tb=native",
        *configuration_options(tree),
        *(options or []),
        *files,
    ]
    subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
    if not report.exists():  # pytest itself failed: nothing ran
        return {file: Outcome("error") for file in files}
    outcomes = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        failure, error = case.find("failure"), case.find("error")
        if failure is not None:
            outcomes[name] = Outcome("failed", *parse_traceback(failure.text or failure.get("message", "")))
        elif error is not None:
            outcomes[name] = Outcome("error", *parse_traceback(error.text or error.get("message", "")))
        else:
            outcomes[name] = Outcome("skipped" if case.find("skipped") is not None else "passed")
    return outcomes


def configuration_options(tree: Path) -> list[str]:
    """pytest's options that keep a run to the tree's own configuration: without one, pytest takes the first it finds
    in a folder above the tree (this project's, whose options then apply and whose folder names the tests)."""
    options = [f"--rootdir={tree}"]
    if not has_pytest_configuration(tree):
        empty = tree.parent / "no-pytest-configuration.ini"
        empty.write_text("[pytest]\n")
        options += ["-c", str(empty)]
    return options


def has_pytest_configuration(tree: Path) -> bool:
    """Whether pytest finds its configuration in ``tree`` itself, by the files and sections it reads."""
    sections = {
        "pyproject.toml": r"^\[tool\.pytest(\.ini_options)?\]",
        "tox.ini": r"^\[pytest\]",
        "setup.cfg": r"^\[tool:pytest\]",
    }
    if (tree / "pytest.ini").is_file() or (tree / ".pytest.ini").is_file():
        return True
    return any(
        (tree / name).is_file() and re.search(section, (tree / name).read_text(errors="replace"), flags=re.MULTILINE)
        for name, section in sections.items()
    )


KINDS = ("passed", "failed", "error", "skipped")


def tally(outcomes: dict[str, Outcome]) -> dict[str, int]:
    return {kind: sum(outcome.kind == kind for outcome in outcomes.values()) for kind in KINDS}


def count(outcomes: dict[str, Outcome]) -> str:
    numbers = tally(outcomes)
    return f"{numbers['passed']} passed, {numbers['failed']} failed" + "".join(
        f", {numbers[kind]} {label}"
        for kind, label in (("error", "errored at setup"), ("skipped", "skipped"))
        if numbers[kind]
    )


def ran(outcomes: dict[str, Outcome]) -> str:
    """How many tests truly ran (passed or failed: not skipped, not errored at setup), and how many passed."""
    numbers = tally(outcomes)
    return f"{numbers['passed'] + numbers['failed']} ran ({numbers['passed']} passed)"


def hunk_lines(patch_text: str) -> dict[str, set[int]]:
    """``{path: line numbers}`` of the released files that the patch's hunks cover (their old side)."""
    lines: dict[str, set[int]] = {}
    path = None
    for line in patch_text.replace("\r\n", "\n").splitlines():
        if line.startswith("--- "):
            path = line[6:] if line.startswith("--- a/") else None
        hunk = re.match(r"@@ -(\d+)(?:,(\d+))? ", line)
        if hunk and path:
            start, length = int(hunk.group(1)), int(hunk.group(2) or 1)
            lines.setdefault(path, set()).update(range(start, start + max(length, 1)))
    return lines


def added_names(patch_text: str) -> set[str]:
    """The names the patch's added lines define: functions, methods, attributes and assignments."""
    added = "\n".join(
        line[1:] for line in patch_text.splitlines() if line.startswith("+") and not line.startswith("+++")
    )
    return set(
        re.findall(r"^\s*(?:async\s+)?def\s+(\w+)", added, flags=re.MULTILINE)
        + re.findall(r"^\s*(?:self\.)?(\w+)\s*(?::[^=\n]*)?=", added, flags=re.MULTILINE)
    )


def failure_proof(outcome: Outcome, tree: Path, patch_text: str, package_folder: str) -> str | None:
    """None where an own test's failure on the released code proves the fix; else why it proves nothing.

    It proves the fix where it fails in the test's own run on an assertion (an ``assert``, ``pytest.raises`` or
    ``pytest.fail``, an assertion helper), on an exception raised in code the patch changes, on one the package
    raises itself (a ``raise`` of its own: the released behaviour the fix removes), or on a missing attribute that
    the patch adds. An error at setup, an import and an exception raised anywhere else (the test file's own code,
    or a library that released code the patch leaves as it is calls, as on an input the test built wrongly) say
    nothing of the fix.
    """
    if outcome.exception in ("ImportError", "ModuleNotFoundError"):
        return "fails on an import"
    if outcome.kind == "error":
        return "errors at setup"
    if outcome.exception in ("AssertionError", "Failed"):
        return None
    if outcome.exception == "AttributeError":
        missing = re.search(r"has no attribute '(\w+)'", outcome.message)
        if missing and missing.group(1) in added_names(patch_text):
            return None
    package_frames = [
        (relative, line, code)
        for path, line, code in outcome.frames
        if (relative := tree_relative(path, tree)) is not None and relative.startswith(package_folder)
    ]
    if package_frames and package_frames[-1][1] in hunk_lines(patch_text).get(package_frames[-1][0], set()):
        return None
    innermost = outcome.frames[-1] if outcome.frames else None
    if package_frames and innermost[1:] == package_frames[-1][1:] and re.match(r"raise\b", innermost[2]):
        return None
    return f"fails on {outcome.exception or 'an error'} raised outside what the patch changes"


def tree_relative(path: str, tree: Path) -> str | None:
    try:
        return str(Path(path).resolve().relative_to(tree.resolve()))
    except ValueError:
        return None


def failure_line(outcome: Outcome, tree: Path) -> str:
    """Where and how a test failed: its innermost frame in the tree, the exception and its message's first line."""
    inside = [(relative, line) for path, line, _ in outcome.frames if (relative := tree_relative(path, tree))]
    where = "{}:{}: ".format(*inside[-1]) if inside else ""
    message = outcome.message if len(outcome.message) <= 100 else outcome.message[:99] + "…"
    return f"{where}{outcome.exception or outcome.kind}" + (f": {message}" if message else "")


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
    own: dict[str, tuple[dict, dict]] = field(default_factory=dict)  # environment: (before, after)
    own_failures: list[list[str]] = field(default_factory=list)  # [test, before (failure line), after]
    upstream: tuple[list[str], dict, dict] | None = None  # files, before, after
    lint: str = ""
    problems: list[str] = field(default_factory=list)


def changes_package(series: Series, tree: Path, files: list[str]) -> bool:
    folder = package_folder(series, tree)
    return any(file.startswith(folder) for file in files)


def package_folder(series: Series, tree: Path) -> str:
    """The package's folder in the patch's paths, e.g. ``src/pytorch_metric_learning/``."""
    return ("src/" if source_root(tree) != tree else "") + series.package + "/"


def own_test_options(index: int, series: Series) -> list[str]:
    """The own tests' pytest options in the series' ``index``-th environment: upstream CI's markers in the first
    (its ``addopts``), the slow tests too in the one with DeepSpeed."""
    return [] if index == 0 else ["-m", series.all_tests_marker]


def check_own_tests(series: Series, result: PatchResult, tree: Path, patch_text: str, files: list[str]) -> None:
    """The rules on a patch's own tests, from their outcomes before and after it in each environment."""
    (ci_name, (before, _)), *_ = result.own.items()
    for name, (_, after) in result.own.items():
        if tally(after)["failed"] or tally(after)["error"]:
            result.problems.append(f"its tests fail after it ({name})")
    if not series.pull_requests:
        return
    if not before:
        result.problems.append("no tests of its own")
    elif not changes_package(series, tree, files):
        if any(outcome.kind != "passed" for outcome in before.values()):
            result.problems.append(f"a documentation patch whose tests do not pass before it ({ci_name})")
    elif not any(outcome.kind in ("failed", "error") for outcome in before.values()):
        result.problems.append(f"its tests pass before it ({ci_name}): they prove no fix")
    else:
        folder = package_folder(series, tree)
        unproven = {
            test: why
            for test, outcome in sorted(before.items())
            if outcome.kind in ("failed", "error") and (why := failure_proof(outcome, tree, patch_text, folder))
        }
        if unproven:
            result.problems.append(
                f"{len(unproven)} of its tests fail before it without proving the fix ({ci_name}): "
                + "; ".join(f"{test} {why}" for test, why in unproven.items())
            )


def check_patch(
    series: Series, envs: dict[str, Path], tree: Path, patch: Path, git_dir: Path | None, cache: Path
) -> PatchResult:
    result = PatchResult(series.name, patch.name[:4])
    ci_name, ci_python = next(iter(envs.items()))
    files = touched(patch)
    patch_text = patch.read_text(errors="replace")
    # Its tests on the code before it: only its test files applied.
    run(["git", "apply", "--include=tests/*", str(patch)], tree)
    own = changed_tests(tree, patch_text)
    befores = {
        name: pytest_outcomes(
            series, python, tree, own, f"{patch.stem[:4]}-own-before-{i}", cache, own_test_options(i, series)
        )
        for i, (name, python) in enumerate(envs.items())
    }
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
        after = pytest_outcomes(
            series, python, tree, own, f"{patch.stem[:4]}-own-after-{i}", cache, own_test_options(i, series)
        )
        result.own[name] = (befores[name], after)
    check_own_tests(series, result, tree, patch_text, files)
    ci_before, ci_after = result.own[ci_name]
    for test in sorted(set(ci_before) | set(ci_after)):
        before = ci_before.get(test)
        shown = "not run" if before is None else before.kind
        if before is not None and before.kind in ("failed", "error"):
            shown = ("fails: " if before.kind == "failed" else "errors: ") + failure_line(before, tree)
        after = ", ".join(
            f"{name}: {outcomes[test].kind if test in outcomes else 'not run'}"
            for name, (_, outcomes) in result.own.items()
        )
        result.own_failures.append([test, shown, after])
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
        broken = sorted(
            name
            for name, value in old.items()
            if value.kind == "passed" and getattr(new.get(name), "kind", "") != "passed"
        )
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
    note = f"{series.name}: upstream tests, docs and skills from {source}; environments: {', '.join(envs)}"
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


def write_report(results: list[PatchResult], notes: list[str], path: Path = REPORT) -> str:
    header = [
        "series",
        "patch",
        "applies",
        "its own tests",
        "upstream tests that exercise it: ran before → after",
        "upstream's lint",
        "verdict",
    ]
    own_header = ["series", "patch", "own test", "before the patch (failure line)", "after it"]
    table = "\n".join(
        ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        + ["| " + " | ".join(row(result)) + " |" for result in results]
        + [""]
        + [f"- {note}" for note in notes]
        + ["", "Each own test before and after its patch (before: without DeepSpeed, as upstream's CI runs it):", ""]
        + ["| " + " | ".join(own_header) + " |", "|" + "---|" * len(own_header)]
        + [
            "| " + " | ".join(cell.replace("|", "\\|") for cell in [result.series, result.patch, *test]) + " |"
            for result in results
            for test in result.own_failures
        ]
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(table + "\n")
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--st-repo", default="https://github.com/huggingface/sentence-transformers")
    parser.add_argument("--pml-repo", default="https://github.com/KevinMusgrave/pytorch-metric-learning")
    parser.add_argument("--series", nargs="*", help="names of series to check (default: all)")
    parser.add_argument("--patches", nargs="*", help="numbers of the patches to check, e.g. 0003 (default: all)")
    parser.add_argument("--report", type=Path, default=REPORT, help=f"where to write the table (default: {REPORT})")
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
            lambda partial: write_report(results + partial, notes, args.report),
        )
        results += checked
        notes.append(note)
    print(write_report(results, notes, args.report))
    return 0 if all(not result.problems for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
