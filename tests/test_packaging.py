"""The library needs only what its losses, models and trainers use; the command line's plots and demo
model are the ``cli`` extra, and importing the command line without it says how to install it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tomllib

from st_ext.cli import CLI_EXTRA_MODULES

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_the_library_imports_nothing_of_the_cli_extra():
    probe = run_python(
        "import sys\n"
        "import st_ext, st_ext.losses, st_ext.models, st_ext.training.trainer, st_ext.offload\n"
        f"print(sorted(m for m in {sorted(CLI_EXTRA_MODULES)!r} if m in sys.modules))\n"
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip().splitlines()[-1] == "[]"  # the last line: DeepSpeed may print on import


def test_the_cli_without_its_extra_names_the_extra():
    for module, distribution in CLI_EXTRA_MODULES.items():
        probe = run_python(f"import sys\nsys.modules[{module!r}] = None\nimport st_ext.cli\n")
        assert probe.returncode != 0
        assert f"needs {distribution}" in probe.stderr and 'pip install "st-ext[cli]"' in probe.stderr


def test_the_cli_extra_is_what_the_cli_imports():
    """pyproject's ``cli`` extra and the modules the check looks for name the same distributions, and the
    library's own dependencies name none of them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = {
        requirement.split(">")[0].split("=")[0].strip() for requirement in project["optional-dependencies"]["cli"]
    }
    assert extra == set(CLI_EXTRA_MODULES.values())
    assert not extra & {requirement.split(">")[0].split("=")[0].strip() for requirement in project["dependencies"]}


def test_the_package_ships_its_type_marker():
    """PEP 561: ``py.typed`` is in the package and pyproject has setuptools put it in the wheel."""
    assert (ROOT / "st_ext" / "py.typed").is_file()
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data["st_ext"]
