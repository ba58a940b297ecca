"""Every use of another library's private API is in ``st_ext/_compat.py``, where a new release breaks it in one place.

Checked on the source with ``ast``: outside ``_compat``, no module reads an attribute whose name starts
with one underscore (``module._parameters``, ``getattr(model, "_orig_mod")``) unless st_ext itself
defines that name, imports a private name or module of another package, or calls ``super()`` for a
private method other than those ``_compat.PRIVATE_METHODS_OVERRIDDEN`` lists with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from st_ext import _compat

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "st_ext"
SOURCES = {path: ast.parse(path.read_text(encoding="utf-8")) for path in sorted(PACKAGE_DIR.rglob("*.py"))}


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def own_names(trees) -> set[str]:
    """The names st_ext defines: functions, classes, variables, arguments and attributes set on ``self``/``cls``."""
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _on_self(node):
                names.add(node.attr)
    return names


def _on_self(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def _is_super_call(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def private_uses(tree: ast.AST, own: set[str]) -> list[str]:
    """``line: what`` for every use of a private name that is not st_ext's own."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr) and not _on_self(node):
            if _is_super_call(node.value):
                if node.attr not in _compat.PRIVATE_METHODS_OVERRIDDEN:
                    found.append(f"{node.lineno}: super().{node.attr}")
            elif node.attr not in own:
                found.append(f"{node.lineno}: .{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
        ):
            name = node.args[1] if len(node.args) > 1 else None
            if (
                isinstance(name, ast.Constant)
                and isinstance(name.value, str)
                and is_private(name.value)
                and name.value not in own
            ):
                found.append(f"{node.lineno}: {node.func.id}(..., {name.value!r})")
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and not node.module.startswith("st_ext")
        ):
            private_module = any(is_private(part) for part in node.module.split("."))
            found += [
                f"{node.lineno}: from {node.module} import {alias.name}"
                for alias in node.names
                if private_module or is_private(alias.name)
            ]
        elif isinstance(node, ast.Import):
            found += [
                f"{node.lineno}: import {alias.name}"
                for alias in node.names
                if any(map(is_private, alias.name.split(".")))
            ]
    return found


OWN = own_names(SOURCES.values())


@pytest.mark.parametrize(
    "path",
    [path for path in SOURCES if path.name != "_compat.py"],
    ids=lambda path: str(path.relative_to(PACKAGE_DIR)),
)
def test_private_apis_are_used_in_compat_only(path):
    uses = private_uses(SOURCES[path], OWN)
    assert not uses, (
        f"{path.relative_to(PACKAGE_DIR.parent)} uses private APIs: {uses}. Put the access in a named function in "
        "st_ext/_compat.py (or list an overridden private method in PRIVATE_METHODS_OVERRIDDEN, with the reason)."
    )


def test_the_check_finds_each_kind_of_private_use():
    source = """
import torch._dynamo
from torch.distributed._composable import fully_shard
from argparse import _StoreAction

class Trainer(Base):
    def _load(self):
        self._mine = 1
        super()._load_rng_state()
        return getattr(model, "_orig_mod", None) or model._parameters or self._mine
"""
    uses = private_uses(ast.parse(source), own_names([ast.parse(source)]))
    assert sorted(use.split(": ", 1)[1] for use in uses) == sorted(
        [
            "import torch._dynamo",
            "from torch.distributed._composable import fully_shard",
            "from argparse import _StoreAction",
            "super()._load_rng_state",
            "getattr(..., '_orig_mod')",
            "._parameters",
        ]
    )
