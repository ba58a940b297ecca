"""The README's two commands as the Makefile runs them: both test halves run, the demo gets only what it
needs, every install is pinned, and the torch build comes from the index the user names."""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def make(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", *args], cwd=ROOT, capture_output=True, text=True)


def test_every_half_runs_after_one_failed_and_the_target_fails_at_the_end():
    result = make("test", "TESTED_ENVS=first second")
    printed = result.stdout + result.stderr
    assert result.returncode != 0
    assert "test-first" in printed and "test-second" in printed, printed
    assert "failed in: first second" in printed


def test_the_demo_environment_gets_no_test_tools_and_pinned_versions():
    recipe = make("-n", "-B", ".venv/demo/.ready").stdout
    assert "requirements/test.txt" not in recipe
    assert "-c requirements/lock/st6.txt" in recipe


@pytest.mark.parametrize("env", ["st6", "st4"])
def test_each_tested_environment_installs_its_lock(env):
    recipe = make("-n", "-B", f".venv/{env}/.ready").stdout
    assert f"-c requirements/lock/{env}.txt" in recipe
    lock = (ROOT / "requirements" / "lock" / f"{env}.txt").read_text().splitlines()
    pins = [line for line in lock if line and not line.startswith("#")]
    assert pins and all("==" in line for line in pins), "every package at one version"
    assert not any(line.startswith(("torch==", "nvidia-")) for line in pins), "torch's build is the user's choice"


def test_torch_comes_from_the_index_the_user_names():
    plain = make("-n", "-B", ".venv/demo/.ready").stdout
    chosen = make("-n", "-B", ".venv/demo/.ready", "TORCH_INDEX=https://example.invalid/whl/cpu").stdout
    assert "--index-url" not in plain
    assert "pip install -q torch==2.13.0 --index-url https://example.invalid/whl/cpu" in chosen


def test_the_tests_print_why_each_skipped_test_was_skipped():
    recipe = make("-n", "test-st6").stdout
    assert ' -m pytest -q -rs -m "not slow"' in recipe


def test_the_quality_benchmark_runs_in_the_tested_environment():
    recipe = make("-n", "bench-quality", "BENCH_QUALITY_ARGS=--hard-negatives").stdout
    assert ".venv/st6/bin/python benchmarks/bench_quality.py --hard-negatives" in recipe


def test_clean_removes_what_the_targets_built_and_no_tracked_file():
    recipe = make("-n", "clean").stdout.split()
    assert recipe[:2] == ["rm", "-rf"], recipe
    removed = recipe[2:]
    assert ".venv" in removed and "runs/st-ext" in removed, removed
    assert "runs" not in removed and "runs/" not in removed, "runs/ holds tracked files"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    for target in removed:
        hits = [f for f in tracked if fnmatch.fnmatch(f, target) or fnmatch.fnmatch(f, target.rstrip("/") + "/*")]
        assert not hits, f"make clean would delete tracked {hits} ({target})"
