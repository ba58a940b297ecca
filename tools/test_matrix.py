"""Run the conformance tests on every minor release of sentence-transformers, one venv each.

`make test-matrix` calls this with the minors that requirements/matrix/st-<minor>.txt pins. Each venv
is built by the Makefile's stamp rule (instant when it is up to date); a minor whose build or tests fail
is recorded and the run goes on to the next one. One summary line is printed per minor, the table is
written to runs/test-matrix.md (pytest's log and JUnit report per minor beside it, in runs/test-matrix/),
and the exit status is non-zero when any minor failed.

    python3 tools/test_matrix.py [--make MAKE] [--venv .venv] [--mark EXPR] MINOR... [-- PYTEST_ARGS...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

RUNS = Path("runs")
LOGS = RUNS / "test-matrix"
REPORT = RUNS / "test-matrix.md"
VERSIONS = (
    "import importlib.metadata as m; "
    "print(m.version('sentence-transformers'), m.version('transformers'), m.version('torch'))"
)


@dataclass
class Result:
    minor: str
    st: str = "?"
    transformers: str = "?"
    torch: str = "?"
    status: str = "not run"
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    build_s: float = 0.0
    test_s: float = 0.0
    failures: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def line(self) -> str:
        return (
            f"st {self.minor:<4} sentence-transformers {self.st:<7} transformers {self.transformers:<8} "
            f"{self.status:<12} passed {self.passed:>4}  failed {self.failed:>3}  skipped {self.skipped:>3}  "
            f"{self.test_s:7.1f} s"
        )


def tee(command: list[str], log: Path) -> int:
    """Run a command, echoing its output and keeping a copy in log."""
    with (
        log.open("w") as out,
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as process,
    ):
        for text in process.stdout:
            sys.stdout.write(text)
            out.write(text)
    return process.returncode


def junit_counts(report: Path, result: Result) -> None:
    """Fill passed/failed/skipped and the failing tests from pytest's JUnit XML."""
    root = ET.parse(report).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = sum(int(s.get("tests", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    result.skipped = sum(int(s.get("skipped", 0)) for s in suites)
    result.failed = failed
    result.passed = total - failed - result.skipped
    for case in root.iter("testcase"):
        for problem in (*case.findall("failure"), *case.findall("error")):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            message = (problem.get("message") or problem.text or "").strip().splitlines()
            result.failures.append((name, message[0] if message else problem.tag))


def run_minor(minor: str, args: argparse.Namespace, pytest_args: list[str]) -> Result:
    result = Result(minor)
    venv = Path(args.venv) / "matrix" / f"st-{minor}"
    log = LOGS / f"st-{minor}.log"
    junit = LOGS / f"st-{minor}.xml"
    junit.unlink(missing_ok=True)

    start = time.monotonic()
    built = tee([args.make, "--no-print-directory", f"{venv}/.ready"], LOGS / f"st-{minor}.build.log")
    result.build_s = time.monotonic() - start
    python = str(venv / "bin" / "python")
    if built != 0 or not Path(python).exists():
        result.status = "venv failed"
        return result

    versions = subprocess.run([python, "-c", VERSIONS], capture_output=True, text=True)
    if versions.returncode == 0:
        result.st, result.transformers, result.torch = versions.stdout.split()
    print(
        f"== sentence-transformers {result.st} (transformers {result.transformers}, torch {result.torch})", flush=True
    )

    start = time.monotonic()
    command = [python, "-m", "pytest", "-q", "-m", args.mark, f"--junitxml={junit}", *pytest_args]
    code = tee(command, log)
    result.test_s = time.monotonic() - start
    if junit.exists():
        junit_counts(junit, result)
    if code == 0:
        result.status = "ok"
    elif code == 5:
        result.status = "no tests"
    elif result.failed:
        result.status = "failed"
    else:
        result.status = f"pytest exit {code}"
    return result


def write_report(results: list[Result], mark: str, total_s: float) -> None:
    rows = [
        f'# Test matrix: `-m "{mark}"` on every minor of sentence-transformers',
        "",
        f"{datetime.now():%Y-%m-%d %H:%M}, {total_s:.0f} s in all (venv builds included). "
        "Pins: requirements/matrix/st-<minor>.txt; logs: runs/test-matrix/.",
        "",
        "| minor | sentence-transformers | transformers | torch | result | passed | failed | skipped | seconds |",
        "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        rows.append(
            f"| {r.minor} | {r.st} | {r.transformers} | {r.torch} | {r.status} | "
            f"{r.passed} | {r.failed} | {r.skipped} | {r.test_s:.1f} |"
        )
    failing = [r for r in results if r.failures]
    if failing:
        rows += ["", "## Failures"]
        for r in failing:
            rows += ["", f"### sentence-transformers {r.st}", ""]
            rows += [f"- `{name}`: {message.replace('|', '/')}" for name, message in r.failures]
    REPORT.write_text("\n".join(rows) + "\n")


def main(argv: list[str]) -> int:
    pytest_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, pytest_args = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--make", default="make", help="the make that builds each venv's stamp")
    parser.add_argument("--venv", default=".venv", help="folder of the venvs; the matrix's go under <venv>/matrix/")
    parser.add_argument("--mark", default="conformance and not slow", help="pytest -m expression")
    parser.add_argument("minors", nargs="+", help="minor releases, e.g. 4.1 5.0 6.2")
    args = parser.parse_args(argv)

    LOGS.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    results: list[Result] = []
    for minor in args.minors:
        results.append(run_minor(minor, args, pytest_args))
        print(f"[matrix] {results[-1].line()}", flush=True)
        write_report(results, args.mark, time.monotonic() - start)
    total_s = time.monotonic() - start
    write_report(results, args.mark, total_s)

    print(f"\n== test matrix ({total_s:.0f} s in all, report in {REPORT})")
    for r in results:
        print(r.line())
    bad = [r.minor for r in results if not r.ok]
    if bad:
        print(f"failed: {' '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
