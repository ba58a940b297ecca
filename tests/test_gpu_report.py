"""``make gpu-report PART=all DRY_RUN=1``: every part of the GPU report runs on the CPU with tiny sizes.

The report is run on a GPU machine only now and then; this keeps a change elsewhere (a benchmark's
arguments, the distributed worker, the memory meter) from breaking it unseen in between. One run of
the whole dry run (a few minutes on 2 cores) serves every check below.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from st_ext._compat import MAX_ST_VERSION, ST_VERSION

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    ST_VERSION != MAX_ST_VERSION, reason="the GPU report runs the release its wheels carry (the newest supported)"
)
PARTS = ["1", "2a", "2b", "2c", "2d", "3", "4", "5", "6", "7", "8"]
VERSION_FIELDS = ["device", "driver", "torch", "sentence_transformers", "transformers"]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[Path, str]:
    """The dry run's output folder and what it printed."""
    out = tmp_path_factory.mktemp("gpu_report")
    command = [sys.executable, str(ROOT / "tools" / "gpu_report.py"), "--part", "all", "--dry-run", "--out", str(out)]
    completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900,
                               env=dict(os.environ, PYTHONUNBUFFERED="1"))  # fmt: skip
    printed = completed.stdout + completed.stderr
    assert completed.returncode == 0, f"the dry run failed; end of its output:\n{printed[-6000:]}"
    return out, printed


@pytest.mark.parametrize("part", PARTS)
def test_every_part_writes_its_table_and_json(report, part):
    out, _ = report
    record = json.loads((out / f"part-{part}.json").read_text())
    for field in VERSION_FIELDS:
        assert record[field], f"part {part}: no {field}"
    assert record["dry_run"] is True
    assert record["rows"], f"part {part}: no result row"
    assert all(row["status"] in ("ok", "skipped") for row in record["rows"]), record["rows"]
    assert any(row["status"] == "ok" for row in record["rows"]), f"part {part}: nothing ran"
    markdown = (out / f"part-{part}.md").read_text()
    assert "| check | status | result | s |" in markdown
    assert record["transformers"] in markdown and record["sentence_transformers"] in markdown


def test_what_needs_cuda_says_so(report):
    out, printed = report
    part1 = json.loads((out / "part-1.json").read_text())
    sync = next(row for row in part1["rows"] if "synchronisation" in row["check"])
    assert sync["status"] == "skipped" and "CUDA" in sync["result"]
    assert "| check | status | result | s |" in printed, "the table is printed"


def test_the_make_target_passes_the_part_and_dry_run():
    dry = subprocess.run(["make", "-n", "gpu-report", "PART=3", "DRY_RUN=1", "GPU_PYTHON=python"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "tools/gpu_report.py --part 3 --out runs/gpu-report-dry-run --dry-run" in dry, (
        "a dry run never overwrites the committed GPU report"
    )
    real = subprocess.run(["make", "-n", "gpu-report", "PART=2a", "GPU_PYTHON=python"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "--part 2a --out runs/gpu-report " in real + " " and "--dry-run" not in real
