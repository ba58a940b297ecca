"""Import directions: the low-level modules never import the layers built on them, and no two parts of st_ext
import each other.

``st_ext._compat``, ``st_ext.scoped_entries``, ``st_ext.gradient_sync``, ``st_ext.memory``, ``st_ext.mining``,
``st_ext.checkpointing`` and every module of ``st_ext.offload`` are what models, losses, training and the
command line build on; an import the other way (at module level or inside a function) would make them depend
on what depends on them. Between the parts (each package and top-level module), the imports form no cycle.
Checked on the source with ``ast``, so nothing is imported to check it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "st_ext"

LOW_LEVEL_FILES = ["_compat.py", "scoped_entries.py", "gradient_sync.py", "memory.py", "mining.py", "checkpointing.py"]
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


# ------------------------------------------------------------------------------------------------ no cycles


def part_of(module: str) -> str | None:
    """The part of st_ext that ``module`` belongs to: its top-level package or module (``st_ext.losses.gist``
    -> ``st_ext.losses``); None outside st_ext and for ``st_ext`` itself, the public namespace every part
    imports its siblings through (``from st_ext import _compat``)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "st_ext" and len(parts) > 1 else None


def part_imports(package_dir: Path) -> dict[tuple[str, str], list[str]]:
    """``(importing part, imported part) -> ["file: imported module", ...]`` for every import from one part of
    st_ext into another, anywhere in a file (functions included)."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(package_dir.rglob("*.py")):
        relative = str(path.relative_to(package_dir))
        module = module_name(relative)
        importer = part_of(module)
        if importer is None:
            continue
        named: list[str] = []  # "a.b" stands for the "a.b.name" of the same import
        for imported in sorted(imported_modules(path.read_text(encoding="utf-8"), module, path.name == "__init__.py")):
            target = part_of(imported)
            if target is None or target == importer or any(imported.startswith(name + ".") for name in named):
                continue
            named.append(imported)
            edges.setdefault((importer, target), []).append(f"{relative}: {imported}")
    return edges


def cycles(edges) -> list[list[str]]:
    """The groups of parts that import each other, directly or around a loop (the strongly connected
    components of more than one part), each sorted, in sorted order."""
    graph: dict[str, set[str]] = {}
    for source, target in edges:
        graph.setdefault(source, set()).add(target)
        graph.setdefault(target, set())

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    reach = {node: reachable(node) for node in graph}
    groups = {frozenset(other for other in graph if other in reach[node] and node in reach[other]) for node in graph}
    return sorted(sorted(group) for group in groups if len(group) > 1)


def describe_cycles(edges) -> str:
    """Each cycle with the imports that close it, one ``importer -> imported`` edge per line."""
    lines = []
    for group in cycles(edges):
        lines.append("cycle between " + ", ".join(group) + ":")
        for (source, target), where in sorted(edges.items()):
            if source in group and target in group:
                lines.append(f"  {source} -> {target}  ({'; '.join(where)})")
    return "\n".join(lines)


def test_the_parts_of_st_ext_import_each_other_in_no_cycle():
    edges = part_imports(PACKAGE_DIR)
    assert ("st_ext.training", "st_ext.losses") in edges  # the graph is read at all
    assert not cycles(edges), (
        "Parts of st_ext import each other; move what both need into a low-level module below them:\n"
        + describe_cycles(edges)
    )


def test_the_cycle_check_finds_loops_of_any_length_and_names_their_imports():
    edges = {
        ("st_ext.losses", "st_ext.training"): ["losses/a.py: st_ext.training.x"],
        ("st_ext.training", "st_ext.cli"): ["training/b.py: st_ext.cli.y"],
        ("st_ext.cli", "st_ext.losses"): ["cli/c.py: st_ext.losses"],
        ("st_ext.cli", "st_ext._compat"): ["cli/c.py: st_ext._compat"],
        ("st_ext.models", "st_ext.memory"): ["models.py: st_ext.memory"],
        ("st_ext.memory", "st_ext.models"): ["memory.py: st_ext.models.z"],
    }
    assert cycles(edges) == [["st_ext.cli", "st_ext.losses", "st_ext.training"], ["st_ext.memory", "st_ext.models"]]
    described = describe_cycles(edges)
    assert "st_ext.training -> st_ext.cli  (training/b.py: st_ext.cli.y)" in described
    assert "st_ext._compat" not in described
    assert cycles({key: value for key, value in edges.items() if key[0] != "st_ext.memory"}) == [
        ["st_ext.cli", "st_ext.losses", "st_ext.training"]
    ]


def test_parts_are_top_level_packages_and_modules():
    assert part_of("st_ext.losses.gist") == "st_ext.losses"
    assert part_of("st_ext.gradient_sync") == "st_ext.gradient_sync"
    assert part_of("st_ext.offload") == "st_ext.offload"
    assert part_of("st_ext") is None and part_of("torch.nn") is None
