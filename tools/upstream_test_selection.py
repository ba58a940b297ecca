"""Which of upstream's test files exercise what a patch changes, found from what the tests import and call.

A file name says little: ``test_cmnrl.py`` tests ``CachedMultipleNegativesRankingLoss``, and the cross-encoder's
``test_cached_multiple_negatives_ranking.py`` tests another class of that name. So the selection works on code:

1. ``changed_targets``: the functions, classes and methods whose lines a patch adds or changes, read from the
   patched tree's AST, and the package's own definitions that use them (a loss class built on a changed mixin or
   helper), two levels deep.
2. ``main`` (run by the series' Python inside the tree, as ``python upstream_test_selection.py``): in each test file
   that imports an object that *is* a target (through any re-export, resolved by importing it), reaches one as an
   attribute of a module it imports, or calls a changed public method whose name few classes define, the tests
   that name it (the whole file where only its helpers do). A changed public method counts only in the tests that
   also name the method: a test that imports ``BaseModel`` to call ``supports`` does not exercise a changed
   ``gradient_checkpointing_enable``. A changed private method reaches tests through the methods of its class that
   call it (so does any changed method); a changed ``__init__`` or generic method (``forward``) through its class.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

#: Method names too common to say which class a test exercises; their class is matched instead.
GENERIC_METHODS = {"forward", "backward", "to", "train", "eval", "get_config_dict", "citation", "extra_repr"}
#: A changed public method is matched by its name alone when at most this many classes of the package define it.
FEW_DEFINITIONS = 2


@dataclass(frozen=True)
class Target:
    module: str  # dotted module name, e.g. "sentence_transformers.base.losses.gradcache"
    name: str  # a top-level function or class of that module
    method: str | None = None  # a method of that class, where the change is inside one


def changed_lines(patch_text: str) -> dict[str, set[int]]:
    """``{path: line numbers in the patched file}`` of the lines each hunk adds (its first line, if it only removes).

    Each hunk is read for as many lines as its header counts, so that what follows the last one (the ``-- ``
    signature of ``git format-patch``) is not taken for a removed line.
    """
    lines: dict[str, set[int]] = {}
    path = None
    new_line = old_left = new_left = hunk_start = 0
    added_in_hunk = False
    for line in patch_text.replace("\r\n", "\n").splitlines():
        if old_left or new_left:
            if line.startswith("+"):
                if path and line[1:].strip():
                    lines.setdefault(path, set()).add(new_line)
                added_in_hunk = True
                new_line += 1
                new_left -= 1
            elif line.startswith("-"):
                if path:
                    lines.setdefault(path, set()).add(new_line)
                old_left -= 1
            elif not line.startswith("\\"):  # a context line; "\ No newline at end of file" counts for nothing
                new_line += 1
                old_left -= 1
                new_left -= 1
            if not (old_left or new_left) and path and not added_in_hunk:
                lines.setdefault(path, set()).add(hunk_start)
            continue
        if line.startswith("+++ "):
            path = line[6:] if line.startswith("+++ b/") else None
            continue
        hunk = re.match(r"@@ -\d+(?:,(\d+))? \+(\d+)(?:,(\d+))? @@", line)
        if hunk:
            old_left = int(hunk.group(1) or 1)
            new_line = hunk_start = int(hunk.group(2))
            new_left = int(hunk.group(3) or 1)
            added_in_hunk = False
    return lines


def module_name(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _spans(node: ast.AST, line: int) -> bool:
    start = min([node.lineno, *(decorator.lineno for decorator in getattr(node, "decorator_list", []))])
    return start <= line <= node.end_lineno


def _enclosing(tree: ast.Module, line: int, source_lines: list[str] | None = None) -> Target | None:
    """The definition that holds ``line``. In a class, a blank line after a method (where lines were removed at
    its end) belongs to that method."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _spans(node, line):
            if not isinstance(node, ast.ClassDef):
                return Target("", node.name)
            methods = [child for child in node.body if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))]
            spanning = [child.name for child in methods if _spans(child, line)]
            if not spanning and source_lines is not None:
                before = [child for child in methods if child.end_lineno < line]
                if before and not "".join(source_lines[before[-1].end_lineno : line]).strip():
                    spanning = [before[-1].name]
            return Target("", node.name, spanning[0] if spanning else None)
    return None


def _reached_through_users(target: Target) -> bool:
    """A private helper or a mixin is not what a test imports: it reaches tests through the definitions using it."""
    return target.method is None and (target.name.startswith("_") or target.name.endswith("Mixin"))


def _referenced_names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def changed_targets(source_root: Path, patch_text: str, package: str, prefix: str = "") -> set[Target]:
    """The definitions a patch changes in ``package`` (a folder of ``source_root``), and their users there.

    ``prefix`` is the folder of ``source_root`` in the patch's paths (``src/`` for a src layout).
    """
    targets: set[Target] = set()
    for path, lines in changed_lines(patch_text).items():
        path = path.removeprefix(prefix)
        if not path.startswith(f"{package}/") or not path.endswith(".py") or not (source_root / path).exists():
            continue
        text = (source_root / path).read_text(encoding="utf-8")
        tree = ast.parse(text)
        for line in lines:
            found = _enclosing(tree, line, text.splitlines())
            if found is not None:
                targets.add(Target(module_name(path), found.name, found.method))
    targets |= _callers_in_class(targets, source_root)
    users = targets
    for _ in range(2):
        reached = {(target.module, target.name) for target in users if _reached_through_users(target)}
        users = _users_of(reached, source_root, package) - targets
        targets |= users
    return targets


def _named_by_class(target: Target) -> bool:
    """Whether naming the class is using the target: the class itself, its ``__init__`` or a generic method."""
    return target.method is None or target.method in GENERIC_METHODS or target.method.startswith("__")


def _callers_in_class(targets: set[Target], tree_root: Path) -> set[Target]:
    """The methods of the same class that call a changed method, ``self.method()``, two levels deep: a changed
    private helper reaches tests through them, and a method kept under a former name through its new one."""
    callers: set[Target] = set()
    for module in {target.module for target in targets if target.method}:
        path = tree_root / (module.replace(".", "/") + ".py")
        if not path.exists():
            path = tree_root / module.replace(".", "/") / "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"))
        classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
        reached = {target for target in targets if target.module == module and target.method}
        for _ in range(2):
            found = set()
            for target in reached:
                for child in getattr(classes.get(target.name), "body", []):
                    if (
                        isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                        and child.name != target.method
                        and target.method in _referenced_names(child)
                    ):
                        found.add(Target(module, target.name, child.name))
            reached = found - callers - targets
            callers |= reached
    return callers


def _users_of(names: set[tuple[str, str]], tree_root: Path, package: str) -> set[Target]:
    """The package's top-level definitions that refer to one of ``names`` (imported from its module, or its own)."""
    users = set()
    for source in sorted((tree_root / package).rglob("*.py")):
        module = module_name(str(source.relative_to(tree_root)))
        tree = ast.parse(source.read_text(encoding="utf-8"))
        visible = {name for owner, name in names if owner == module}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported_from = _absolute(node, module, source.name == "__init__.py")
                visible |= {alias.asname or alias.name for alias in node.names if (imported_from, alias.name) in names}
        if not visible:
            continue
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if (module, node.name) in names or not _referenced_names(node) & visible:
                continue
            # In a class, the methods that use it (the class itself where e.g. a class attribute does)
            methods = [
                child.name
                for child in node.body
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and _referenced_names(child) & visible
            ]
            # e.g. a base class or a class attribute: the whole class uses it
            outside = [
                child
                for child in [*getattr(node, "bases", []), *node.decorator_list, *node.body]
                if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                and _referenced_names(child) & visible
            ]
            if isinstance(node, ast.ClassDef) and methods and not outside:
                users |= {Target(module, node.name, method) for method in methods}
            else:
                users.add(Target(module, node.name))
    return users


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def changed_tests(tree_root: Path, patch_text: str) -> list[str]:
    """The pytest node ids of the tests a patch adds or changes: a new test file whole, else each test function
    (or test class) with a line the patch adds, so that upstream's other tests in a file it extends are not
    counted as its own."""
    created = set(
        re.findall(r"^diff --git a/(\S+) b/\S+\nnew file mode", patch_text.replace("\r\n", "\n"), flags=re.MULTILINE)
    )
    nodes = []
    for path, lines in sorted(changed_lines(patch_text).items()):
        if not (path.startswith("tests/") and Path(path).name.startswith("test_") and path.endswith(".py")):
            continue
        if path in created:
            nodes.append(path)
            continue
        tree = ast.parse((tree_root / path).read_text(encoding="utf-8"))
        names = {found.name for line in lines if (found := _enclosing(tree, line)) is not None}
        nodes += [f"{path}::{name}" for name in sorted(names) if name.startswith(("test", "Test"))]
    return nodes


def callable_methods(targets: set[Target], tree_root: Path, package: str) -> set[str]:
    """The changed public methods whose name says which class a test calls: few classes define it."""
    counts = _method_definitions(tree_root, package)
    return {
        target.method
        for target in targets
        if target.method
        and not target.method.startswith("_")
        and not target.name.startswith("_")
        and target.method not in GENERIC_METHODS
        and counts.get(target.method, 0) <= FEW_DEFINITIONS
    }


def _method_definitions(tree_root: Path, package: str) -> dict[str, int]:
    """How many classes of the package define each method name."""
    counts: dict[str, int] = {}
    for source in (tree_root / package).rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                for child in node.body:
                    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        counts[child.name] = counts.get(child.name, 0) + 1
    return counts


def _test_file_matches(test_file: Path, targets: dict[Target, object], callable_methods: set[str]) -> list[str]:
    """The tests of ``test_file`` that use a target: ``file::test`` for each test function or class that names one
    (imported, reached through an imported module, or called by a method name), the whole file if the file uses
    one and none of its tests names it itself (e.g. through a helper); nothing if the file uses none."""
    tree = ast.parse(test_file.read_text(encoding="utf-8"))
    identifiers = _referenced_names(tree)
    imported: list[tuple[str, object]] = []  # (the name the file binds, the object)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported += [((alias.asname or alias.name).split(".")[0], _import(alias.name)) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            module = _import(node.module)
            if module is not None:
                imported += [(alias.asname or alias.name, getattr(module, alias.name, None)) for alias in node.names]
    # (a name in the file that stands for a target's class or function, the method a test must name too, if any)
    used: set[tuple[str, str | None]] = set()
    for target, value in targets.items():
        method = None if _named_by_class(target) else target.method
        for bound, thing in imported:
            if thing is value:
                used.add((bound, method))
            elif (
                isinstance(thing, ModuleType)
                and target.name in identifiers
                and getattr(thing, target.name, None) is value
            ):
                used.add((target.name, method))
        if target.method in callable_methods:
            used.add((target.method, None))

    def uses(names: set[str]) -> bool:
        return any(name in names and (method is None or method in names) for name, method in used)

    if not uses(identifiers):
        return []
    tests = [
        f"{test_file}::{node.name}"
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.name.startswith(("test", "Test"))
        and uses(_referenced_names(node))
    ]
    return tests or [str(test_file)]


def _import(name: str):
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001  (a test's optional dependency that is not installed)
        return None


def main() -> None:
    """``python upstream_test_selection.py REQUEST.json ANSWER.json TEST_FILE...``: writes ``{test file: [tests]}``.

    The request holds ``targets`` (``[module, name, method]``) and ``callable_methods``.
    """
    request = json.loads(Path(sys.argv[1]).read_text())
    targets = {}
    for module, name, method in request["targets"]:
        value = getattr(_import(module), name, None)
        if value is not None:
            targets[Target(module, name, method)] = value
    callable_methods = set(request["callable_methods"])
    matches = {}
    for test_file in sys.argv[3:]:
        try:
            hits = _test_file_matches(Path(test_file), targets, callable_methods)
        except SyntaxError:
            continue
        if hits:
            matches[test_file] = hits
    Path(sys.argv[2]).write_text(json.dumps(matches))


if __name__ == "__main__":
    main()
