"""The supported sentence-transformers range is enforced when st_ext is imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from st_ext import _compat

pytestmark = pytest.mark.conformance

FIX = "pip install 'sentence-transformers>=4.1.0,<6.3'"


@pytest.mark.parametrize("version", ["3.4.1", "4.0.2", "6.3.0", "6.3.0.dev0", "7.0.0"])
def test_an_unsupported_release_is_refused_with_the_fix(version):
    with pytest.raises(ImportError) as raised:
        _compat.check_supported_version(version)
    message = str(raised.value)
    assert f"sentence-transformers {version} is installed" in message
    assert f"{_compat.MIN_ST_VERSION} … {_compat.MAX_ST_VERSION}" in message
    assert FIX in message


@pytest.mark.parametrize("version", ["4.1.0", "5.0.0", "6.2.0", "6.2.1", str(_compat.ST_VERSION)])
def test_a_supported_release_passes(version):
    _compat.check_supported_version(version)


def test_the_range_is_pyprojects():
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    requirements = [Requirement(line) for line in pyproject["project"]["dependencies"]]
    (requirement,) = [r for r in requirements if r.name == "sentence-transformers"]
    assert requirement.specifier == SpecifierSet(_compat.ST_REQUIREMENT)
    assert requirement.specifier.contains(_compat.MIN_ST_VERSION)
    assert requirement.specifier.contains(_compat.MAX_ST_VERSION)


def test_importing_st_ext_on_an_unsupported_release_fails_with_the_fix():
    """The check runs when st_ext's names load: a release that claims to be 3.4.1 stops
    ``from st_ext import SentenceTransformer`` (``import st_ext`` alone loads nothing, for ``st-ext --help``)."""
    code = "import sentence_transformers; sentence_transformers.__version__ = '3.4.1'; from st_ext import SentenceTransformer"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode != 0
    assert "ImportError" in done.stderr and "sentence-transformers 3.4.1 is installed" in done.stderr
    assert FIX in done.stderr


def test_deepspeed_gradients_ready_marks_each_parameter_for_the_block_only():
    """ZeRO reads the mark on each parameter; outside the block every parameter is as it was, unmarked or not."""
    unmarked, marked = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    marked.ds_grad_is_ready = True
    held = _compat.deepspeed_gradients_ready([unmarked, marked], ready=False)
    assert not hasattr(unmarked, "ds_grad_is_ready")  # nothing happens before the block
    with held:
        assert unmarked.ds_grad_is_ready is False and marked.ds_grad_is_ready is False
    assert not hasattr(unmarked, "ds_grad_is_ready") and marked.ds_grad_is_ready is True
