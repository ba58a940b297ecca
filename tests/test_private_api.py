"""Every use of another library's private API is in ``st_ext/_compat.py``, where a new release breaks it in one place.

Checked on the source with ``ast``: outside ``_compat``, no module reads an attribute whose name starts
with one underscore (``module._parameters``, ``getattr(model, "_orig_mod")``) unless st_ext itself
defines that name, imports a private name or module of another package, or calls ``super()`` for a
private method other than those ``_compat.PRIVATE_METHODS_OVERRIDDEN`` lists with its reason.

Nor does it name an internal whose name looks public (DeepSpeed's ``ds_*`` parameter attributes,
transformers' ``hf_deepspeed_config`` and ``deepspeed_config``, FSDP2's parameter-group fields, DDP's
sync flags, wrappers' attributes for what they wrap), or tell a class or function apart by the module
that defined it or by its name: each such reading is a named function of ``_compat``.
"""

from __future__ import annotations

import ast
import re
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


# ------------------------------------------------------------------------ internals with public-looking names

#: Internals whose names carry no underscore, or that appear as strings: transformers' DeepSpeed
#: configuration (an attribute of ``TrainingArguments`` and a module-level function), FSDP2's parameter
#: group and its fields, DDP's sync flags, and the attributes by which activation checkpointing's
#: wrapper and ``torch.compile``'s hold the module they wrap.
INTERNAL_NAMES = frozenset(
    {
        "hf_deepspeed_config",
        "deepspeed_config",
        "_fsdp_param_group",
        "post_forward_mesh_info",
        "reshard_after_backward",
        "require_backward_grad_sync",
        "require_forward_param_sync",
        "_checkpoint_wrapped_module",
        "_orig_mod",
    }
)
#: DeepSpeed's attributes on parameters (``ds_id``, ``ds_grad_is_ready``, ``ds_tensor``, ...).
DEEPSPEED_ATTRIBUTE = re.compile(r"ds_\w+")
#: Methods that match a string against another (``str.startswith``, ``re.match``, ...).
STRING_MATCHERS = frozenset(
    {"startswith", "endswith", "find", "rfind", "index", "rindex", "split", "rsplit", "partition", "rpartition"}
    | {"match", "fullmatch", "search"}
)
#: The attributes that name a class or function, and the one that names the module that defined it.
NAME_ATTRIBUTES = frozenset({"__name__", "__qualname__"})


def is_internal_name(name: str) -> bool:
    return name in INTERNAL_NAMES or DEEPSPEED_ATTRIBUTE.fullmatch(name) is not None


def _reads_attribute(node: ast.AST, names: frozenset[str]) -> bool:
    """Whether ``node`` reads one of ``names`` from an object (``x.__module__``, ``getattr(x, "__module__")``)."""
    for inner in ast.walk(node):
        if isinstance(inner, ast.Attribute) and inner.attr in names and isinstance(inner.ctx, ast.Load):
            return True
        if (
            isinstance(inner, ast.Call)
            and isinstance(inner.func, ast.Name)
            and inner.func.id in ("getattr", "hasattr")
            and len(inner.args) > 1
            and isinstance(inner.args[1], ast.Constant)
            and inner.args[1].value in names
        ):
            return True
    return False


def _holds_string(node: ast.AST) -> bool:
    """Whether ``node`` is a string literal, or a tuple, list or set of them."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and bool(node.elts) and all(map(_holds_string, node.elts))


def _matched(node: ast.AST) -> list[ast.AST]:
    """What ``node`` compares or matches: a comparison's operands, a string matcher's receiver and arguments."""
    if isinstance(node, ast.Compare):
        return [node.left, *node.comparators]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in STRING_MATCHERS:
        return [node.func.value, *node.args]
    return []


def internal_uses(tree: ast.AST) -> list[str]:
    """``line: what`` for every use of an internal with a public-looking name, every comparison or string
    match on a ``__module__``, and every comparison or match of a ``__name__``/``__qualname__`` with a string."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_internal_name(node.attr):
            found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and is_internal_name(node.value):
            found.append(f"{node.lineno}: {node.value!r}")
        elif isinstance(node, ast.ImportFrom):
            found += [f"{node.lineno}: import {alias.name}" for alias in node.names if is_internal_name(alias.name)]
        operands = _matched(node)
        if any(_reads_attribute(operand, frozenset({"__module__"})) for operand in operands):
            found.append(f"{node.lineno}: __module__ compared")
        elif any(_reads_attribute(operand, NAME_ATTRIBUTES) for operand in operands) and any(
            map(_holds_string, operands)
        ):
            found.append(f"{node.lineno}: class name compared with a string")
    return found


@pytest.mark.parametrize(
    "path",
    [path for path in SOURCES if path.name != "_compat.py"],
    ids=lambda path: str(path.relative_to(PACKAGE_DIR)),
)
def test_internals_with_public_names_are_read_in_compat_only(path):
    uses = internal_uses(SOURCES[path])
    assert not uses, (
        f"{path.relative_to(PACKAGE_DIR.parent)} reads library internals or tells objects apart by module or "
        f"name: {uses}. Put the reading in a named function in st_ext/_compat.py, whose docstring says which "
        "library and release it reads."
    )


def test_the_check_finds_each_kind_of_internal_use():
    source = """
from transformers.integrations.deepspeed import deepspeed_config

def probe(args, param, group, hook, module, model):
    config = getattr(args, "hf_deepspeed_config", None) or args.hf_deepspeed_config
    partitioned = hasattr(param, "ds_id")
    param.ds_grad_is_ready = False
    kept = group.post_forward_mesh_info is None and group.reshard_after_backward
    vars(model).update({"require_backward_grad_sync": True})
    wrappers = frozenset({"_checkpoint_wrapped_module", "_orig_mod"})
    fsdp = (getattr(hook, "__module__", None) or "").startswith("torch.distributed.fsdp")
    own = cls.__dict__.get("own_module", cls.__module__).startswith("st_ext.")
    local = [value for value in values if value.__module__ == module.__name__]
    wrapped = type(module).__name__ == "CheckpointWrapper" or type(module).__qualname__ in ("A", "B")
    compiled = type(model).__name__.endswith("OptimizedModule")
"""
    uses = [use.split(": ", 1)[1] for use in internal_uses(ast.parse(source))]
    assert sorted(uses) == sorted(
        [
            "import deepspeed_config",
            "'hf_deepspeed_config'",
            ".hf_deepspeed_config",
            "'ds_id'",
            ".ds_grad_is_ready",
            ".post_forward_mesh_info",
            ".reshard_after_backward",
            "'require_backward_grad_sync'",
            "'_checkpoint_wrapped_module'",
            "'_orig_mod'",
            "__module__ compared",
            "__module__ compared",
            "__module__ compared",
            "class name compared with a string",
            "class name compared with a string",
            "class name compared with a string",
        ]
    )


def test_the_check_leaves_names_in_messages_and_public_setters_alone():
    source = """
if __name__ == "__main__":
    run()
name = type(module).__name__
message = f"{name} needs ds_id on its parameters"
module.set_reshard_after_backward(False, recurse=False)
model.set_requires_gradient_sync(True)
STATES_PER_PARAMETER.get(type(optimizer).__name__, 2)
"""
    assert internal_uses(ast.parse(source)) == []
