"""Import directions: the low-level modules never import the layers built on them.

``st_ext._compat``, ``st_ext.memory``, ``st_ext.mining``, ``st_ext.checkpointing`` and every module of
``st_ext.offload`` are what models, losses, training and the command line build on; an import the
other way (at module level or inside a function) would make them depend on what depends on them.
Checked on the source with ``ast``, so nothing is imported to check it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "st_ext"

LOW_LEVEL_FILES = ["_compat.py", "memory.py", "mining.py", "checkpointing.py"]
#: Every file of the offload package, found by glob so that new ones are covered.
OFFLOAD_FILES = sorted(str(path.relative_to(PACKAGE_DIR)) for path in (PACKAGE_DIR / "offload").rglob("*.py"))

#: The higher layers (a package or module and everything below it).
HIGHER_LAYERS = ("st_ext.models", "st_ext.training", "st_ext.losses", "st_ext.cli")


def module_name(relative_path: str) -> str:
    """``offload/placement.py`` -> ``st_ext.offload.placement``; a package's ``__init__.py`` -> the package."""
    parts = ["st_ext", *Path(relative_path).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool) -> set[str]:
    """Every module ``source`` imports anywhere (functions and classes included), relative imports
    resolved, ``from package import name`` counted as ``package.name`` too (it may be a submodule), and
    ``importlib.import_module`` with a literal name."""
    found = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Call) and _called_name(node.func) in ("import_module", "importlib.import_module"):
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                found.add(node.args[0].value)
    return found


def _called_name(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return f"{func.value.id}.{func.attr}"
    return ""


def upward_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """The imports of ``source`` that reach a higher layer."""
    imports = imported_modules(source, module, is_package)
    return sorted(name for name in imports if any(name == top or name.startswith(top + ".") for top in HIGHER_LAYERS))


def test_the_low_level_files_exist():
    """A renamed module would otherwise drop out of the check without anyone noticing."""
    missing = [name for name in LOW_LEVEL_FILES if not (PACKAGE_DIR / name).is_file()]
    assert not missing, f"update LOW_LEVEL_FILES in {Path(__file__).name}: {missing} no longer exist"
    assert "offload/__init__.py" in OFFLOAD_FILES


def test_the_higher_layers_exist():
    """A layer that was renamed or moved would otherwise stop being checked for, silently."""
    root = PACKAGE_DIR.parent
    missing = [
        layer
        for layer in HIGHER_LAYERS
        if not (root / layer.replace(".", "/")).is_dir() and not (root / (layer.replace(".", "/") + ".py")).is_file()
    ]
    assert not missing, f"update HIGHER_LAYERS in {Path(__file__).name}: {missing} no longer exist"


@pytest.mark.parametrize("relative_path", LOW_LEVEL_FILES + OFFLOAD_FILES)
def test_low_level_modules_import_no_higher_layer(relative_path):
    path = PACKAGE_DIR / relative_path
    module = module_name(relative_path)
    upward = upward_imports(path.read_text(encoding="utf-8"), module, is_package=path.name == "__init__.py")
    assert not upward, (
        f"{module} is a low-level module but imports {upward}: move what it needs down into a low-level "
        "module (or the code that needs the higher layer up into that layer)."
    )


SNEAKY = """
import torch
from st_ext.mining import rank_in_row

def later():
    from st_ext import losses
    from .. import training
    from ..cli.main import run
    import st_ext.training.loop
    importlib.import_module("st_ext.models")
"""


def test_the_check_sees_function_level_relative_and_dynamic_imports():
    assert upward_imports(SNEAKY, "st_ext.offload.placement") == [
        "st_ext.cli.main",
        "st_ext.cli.main.run",
        "st_ext.losses",
        "st_ext.models",
        "st_ext.training",
        "st_ext.training.loop",
    ]
    assert upward_imports("from . import guards", "st_ext.offload", is_package=True) == []
    assert upward_imports("from .. import cli", "st_ext.offload", is_package=True) == ["st_ext.cli"]
