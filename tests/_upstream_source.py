"""
Released source trees of upstream packages, with the patches from ``patches/`` applied.

The patches are written for the sources as they are published on PyPI, so they are checked against the released
sdist rather than against a git checkout: the two can differ (some sdists ship CRLF line endings where the
repository has LF). Sdists are cached in ``<repo>/.venv/sdists`` so that only the first run needs the network.
``tools/patches_check.py`` and ``benchmarks/bench_pml_patch.py`` fetch and unpack the sdists through it too.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PATCHES_DIR = REPO_ROOT / "patches"
SDIST_CACHE = REPO_ROOT / ".venv" / "sdists"


class UpstreamSourceError(RuntimeError):
    """The released source could not be fetched, unpacked or patched."""


def patch_files(name: str, version: str) -> list[Path]:
    """The numbered patches in ``patches/<name>/<version>/``, in the order ``git am`` would apply them."""
    return sorted((PATCHES_DIR / name / version).glob("[0-9][0-9][0-9][0-9]-*.patch"))


def patched_source(
    name: str, version: str, patches: Sequence[Path], dest: Path, cache_dir: Path = SDIST_CACHE
) -> Path:
    """
    Unpack the released sdist of ``name==version`` into ``dest``, apply ``patches`` in order, and return the
    root of the source tree. Put that root on ``PYTHONPATH`` for a flat layout, or its ``src`` for a src layout.
    """
    root = unpack_sdist(sdist_path(name, version, cache_dir), dest)
    for patch in patches:
        apply_patch(root, patch)
    return root


def sdist_path(name: str, version: str, cache_dir: Path = SDIST_CACHE) -> Path:
    """The released sdist of ``name==version`` in ``cache_dir``, downloaded there with pip if it is missing."""
    cached = _find_sdist(name, version, cache_dir)
    if cached is not None:
        return cached
    cache_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
        f"{name}=={version}", "-d", str(cache_dir),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    cached = _find_sdist(name, version, cache_dir)
    if result.returncode != 0 or cached is None:
        raise UpstreamSourceError(
            f"could not download the sdist of {name}=={version} into {cache_dir} "
            f"(pip exited with {result.returncode}); place it there by hand to work offline.\n"
            f"$ {' '.join(command)}\n{result.stderr.strip()}"
        )
    return cached


def unpack_sdist(sdist: Path, dest: Path) -> Path:
    """Unpack ``sdist`` into ``dest`` and return its single top-level directory."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as archive:
        # The "data" filter refuses absolute paths and links out of dest; older Pythons lack it.
        extract_kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        archive.extractall(dest, **extract_kwargs)
    roots = [path for path in dest.iterdir() if path.is_dir()]
    if len(roots) != 1:
        raise UpstreamSourceError(f"{sdist.name} should hold one top-level directory, found {len(roots)}")
    return roots[0]


def apply_patch(root: Path, patch: Path) -> None:
    """
    Apply one patch to the tree at ``root`` with ``git apply``, without whitespace or line-ending leniency, as
    the patch would be applied to the published sources (but for the documentation and the tests, which they do
    not ship).
    """
    # Outside a repository `git apply` patches the files as they are; keep it from finding an enclosing one.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(root.parent)}
    # The patches are made for the repositories; released sdists ship no documentation, skills or tests to update
    # (a patch's tests extend upstream's test files, and `make patches-check` runs them in the repository's tests/).
    command = ["git", "apply", "--exclude=docs/*", "--exclude=skills/*", "--exclude=tests/*", str(patch)]
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise UpstreamSourceError(f"{patch.name} does not apply to {root.name}:\n{result.stderr.strip()}")


def _find_sdist(name: str, version: str, cache_dir: Path) -> Path | None:
    """The ``.tar.gz`` sdist of ``name==version`` in ``cache_dir``, whichever spelling of the name it uses."""
    suffix = f"-{version}.tar.gz"
    for path in cache_dir.glob(f"*{suffix}"):
        if _normalize(path.name[: -len(suffix)]) == _normalize(name):
            return path
    return None


def _normalize(name: str) -> str:
    """A project name as PEP 503 compares it, with ``_`` as separator: sdists spell it either way."""
    return re.sub(r"[-_.]+", "_", name).lower()


def start_check_script(script: str | Path, pythonpath: Path | None, log_dir: Path, *args: str) -> subprocess.Popen:
    """
    Run ``script`` (a test file that doubles as a check script) in a fresh interpreter, importing upstream from
    ``pythonpath`` or else the installed package. Output goes to files in ``log_dir``: two runs side by side must
    not block on full pipes.
    """
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    log_dir.mkdir(parents=True)
    with open(log_dir / "stdout", "w") as stdout, open(log_dir / "stderr", "w") as stderr:
        command = [sys.executable, str(script), *args]
        return subprocess.Popen(command, env=env, stdout=stdout, stderr=stderr, cwd=log_dir)


def collect_check_script(process: subprocess.Popen, log_dir: Path, timeout: float = 300) -> dict:
    """The JSON a check script printed last; its stderr becomes the failure message if it crashed or hung."""
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    lines = (log_dir / "stdout").read_text().strip().splitlines()
    if process.returncode != 0 or not lines:
        stderr = (log_dir / "stderr").read_text()
        import pytest  # here: tools/patches_check.py and the benchmarks use this module without pytest

        pytest.fail(f"the checks in {log_dir} exited with {process.returncode}:\n{stderr[-4000:]}")
    return json.loads(lines[-1])
