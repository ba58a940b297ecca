"""The pytorch-metric-learning patch applies to the released 2.9.0 sources and changes no result.

The sdist is cached under ``.venv/sdists`` (``make`` downloads it there; this test does the same
when it is missing). It is unpacked, patched with ``git apply``, and the patched
``get_all_triplets_indices`` runs in a subprocess whose PYTHONPATH puts the patched ``src`` first;
its triplets must equal those of the installed, unpatched release.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest
import torch
from pytorch_metric_learning.utils import loss_and_miner_utils as released

REPO_ROOT = Path(__file__).resolve().parent.parent
SDIST_CACHE = REPO_ROOT / ".venv" / "sdists"
PATCH_DIR = REPO_ROOT / "patches" / "pytorch-metric-learning" / "2.9.0"
REQUIREMENT = "pytorch-metric-learning==2.9.0"
PATCHED_FILE = Path("src/pytorch_metric_learning/utils/loss_and_miner_utils.py")
INT_MAX = torch.iinfo(torch.int32).max


def find_sdist() -> Path | None:
    matches = sorted(SDIST_CACHE.glob("pytorch[-_]metric[-_]learning-2.9.0.tar.gz"))
    return matches[0] if matches else None


def released_sdist() -> Path:
    """The released sources, downloaded once into the cache the Makefile also fills."""
    sdist = find_sdist()
    if sdist is None:
        SDIST_CACHE.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", REQUIREMENT]
        result = subprocess.run(command + ["-d", str(SDIST_CACHE)], capture_output=True, text=True)
        sdist = find_sdist()
        if sdist is None:
            pytest.skip(f"could not download the {REQUIREMENT} sdist (is PyPI reachable?): {result.stderr[-500:]}")
    return sdist


def unpack(sdist: Path, destination: Path) -> Path:
    """Unpack the sdist and return its top folder (the root the patch paths are relative to)."""
    with tarfile.open(sdist) as archive:
        if hasattr(tarfile, "data_filter"):
            archive.extractall(destination, filter="data")
        else:
            archive.extractall(destination)
    (root,) = [path for path in destination.iterdir() if path.is_dir()]
    return root


def apply_patches(source_root: Path) -> list[Path]:
    """``git apply`` every patch in order, after checking that each applies cleanly (but for its documentation
    changes: the sdist ships none)."""
    patches = sorted(PATCH_DIR.glob("*.patch"))
    assert patches, f"no patch in {PATCH_DIR}"
    for patch in patches:
        for check_only in (True, False):
            command = (
                ["git", "apply", "--verbose", "--exclude=docs/*"] + (["--check"] if check_only else []) + [str(patch)]
            )
            result = subprocess.run(command, cwd=source_root, capture_output=True, text=True)
            assert result.returncode == 0, f"{patch.name} does not apply:\n{result.stderr}"
    return patches


def label_sets() -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Random labels over both paths of the patched function, and one case past INT_MAX."""
    generator = torch.Generator().manual_seed(0)

    def randint(high: int, size: int) -> torch.Tensor:
        return torch.randint(0, high, (size,), generator=generator)

    cases = [
        (randint(5, 40), None),  # tiny: dense path
        (randint(5, 40), randint(5, 30)),
        (randint(100, 21), randint(100, 3000)),  # grouped path, memory bank
        (randint(30, 300), None),  # grouped path, batch against itself
        (randint(1, 80), None),  # one class: no triplets
        (torch.arange(120), None),  # all distinct: no triplets
    ]
    big_memory = torch.arange(1000, 11200)  # B·M·M > INT_MAX, few shared classes
    big_memory[torch.randperm(len(big_memory), generator=generator)[:25]] = randint(4, 25)
    cases.append((randint(4, 21), big_memory))
    assert len(cases[-1][0]) * len(big_memory) ** 2 > INT_MAX
    return cases


SUBPROCESS_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import pytorch_metric_learning.utils.loss_and_miner_utils as lmu

    cases = torch.load(sys.argv[1])
    outputs = {"module_file": lmu.__file__, "triplets": [], "grouped": []}
    for labels, ref_labels in cases:
        outputs["triplets"].append(lmu.get_all_triplets_indices(labels, ref_labels))
        outputs["grouped"].append(lmu.get_all_triplets_indices_grouped_method(labels, ref_labels))
    torch.save(outputs, sys.argv[2])
    """)


@pytest.fixture(scope="module")
def patched_source(tmp_path_factory) -> Path:
    if shutil.which("git") is None:
        pytest.skip("git is needed to apply the patch")
    source_root = unpack(released_sdist(), tmp_path_factory.mktemp("pml_sdist"))
    original = (source_root / PATCHED_FILE).read_bytes()
    apply_patches(source_root)
    patched = (source_root / PATCHED_FILE).read_bytes()
    assert patched != original
    assert b"\r\n" not in patched or b"\r\n" in original, "the patch changed line endings"
    return source_root


def test_patch_applies_to_released_sources(patched_source):
    text = (patched_source / PATCHED_FILE).read_text()
    assert "def get_all_triplets_indices_grouped_method(" in text
    # The functions upstream's own tests call are still there.
    assert "def get_all_triplets_indices_vectorized_method(" in text
    assert "def get_all_triplets_indices_loop_method(" in text


def test_patched_triplets_equal_released(patched_source, tmp_path):
    cases = label_sets()
    torch.save(cases, tmp_path / "cases.pt")
    (tmp_path / "run.py").write_text(SUBPROCESS_SCRIPT)
    environment = dict(os.environ, PYTHONPATH=str(patched_source / "src"))
    result = subprocess.run(
        [sys.executable, str(tmp_path / "run.py"), str(tmp_path / "cases.pt"), str(tmp_path / "out.pt")],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    outputs = torch.load(tmp_path / "out.pt")

    assert Path(outputs["module_file"]).resolve() == (patched_source / PATCHED_FILE).resolve()
    assert Path(released.__file__).resolve() != Path(outputs["module_file"]).resolve()
    for (labels, ref_labels), patched, grouped in zip(cases, outputs["triplets"], outputs["grouped"]):
        expected = released.get_all_triplets_indices(labels, ref_labels)
        for expected_column, patched_column, grouped_column in zip(expected, patched, grouped):
            assert patched_column.dtype == grouped_column.dtype == torch.int64
            assert torch.equal(expected_column.long(), patched_column)
            assert torch.equal(expected_column.long(), grouped_column)
