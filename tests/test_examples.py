"""Every example runs end to end, offline, with a tiny step count."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# script -> (quick arguments, a line fragment the script prints when it has shown what it is for)
QUICK_RUNS = {
    "cached_matryoshka.py": (["--max-steps", "1", "--batch-size", "16"], "peak memory of one step"),
    "cached_matryoshka_2d.py": (["--max-steps", "1", "--batch-size", "16"], "NDCG@10 on"),
    "cached_gist_guide.py": (["--max-steps", "1", "--batch-size", "8"], "is fully released"),
    "cross_encoder_checkpointing.py": (["--max-steps", "1"], "activation memory"),
    "decoder_lora.py": (["--max-steps", "1", "--batch-size", "8"], "embeddings identical after reloading: True"),
    "distillation_teacher.py": (["--max-steps", "1", "--batch-size", "8"], "is fully released"),
    "triplet_cross_batch_memory.py": (
        ["--max-steps", "2", "--batch-size", "8", "--memory-size", "32"],
        "identical after loading: True",
    ),
}


def test_every_example_is_covered():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(QUICK_RUNS)


@pytest.mark.parametrize("script", sorted(QUICK_RUNS))
def test_example_runs(script, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    quick_args, shown = QUICK_RUNS[script]
    command = [sys.executable, str(EXAMPLES / script), *quick_args, "--output-dir", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert shown in result.stdout, result.stdout


@pytest.mark.parametrize("script", sorted(QUICK_RUNS))
def test_example_help_describes_every_option_with_its_default(script):
    """``--help`` says what the script is for, and what each option does and defaults to."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    usage, _, rest = result.stdout.partition("\n\n")
    description, _, options = rest.partition("\n\n")
    assert description.strip() and not description.startswith("options"), result.stdout
    entries = re.split(r"\n  (?=-)", options)[1:]
    assert entries, result.stdout
    for entry in entries:
        if entry.startswith("-h, --help"):
            continue
        assert "(default:" in entry, f"{script}: no default in {entry!r}"
        assert len(entry.split(None, 2)) > 2, f"{script}: no description in {entry!r}"
