"""``st-ext swap-imports FILE...``: rewrite a training script's sentence-transformers imports to st_ext's.

The contract (README, "Swap the imports"), for scripts written against sentence-transformers 4.x, 5.x or 6.x:

* ``from sentence_transformers import ...``: every name st_ext has moves to ``from st_ext import ...``
  (st_ext's models, trainers and ``losses``, and upstream's other top-level names, which st_ext hands on as
  they are); a name st_ext lacks (``evaluation``...) stays on a ``from sentence_transformers import`` line.
* the losses, wherever a release put them (``sentence_transformers.losses``, deprecated in 6.x, and
  ``sentence_transformers.sentence_transformer.losses``): ``from st_ext.losses import ...``, every name
  (``st_ext.losses`` has each upstream loss, st_ext's own in place of those it replaces);
  ``from sentence_transformers.sentence_transformer import losses`` becomes ``from st_ext import losses``.
* the models and trainers from their own modules (``sentence_transformers.trainer``,
  ``sentence_transformers.cross_encoder``, ``sentence_transformers.sentence_transformer.trainer``, ...):
  the names st_ext replaces move to ``from st_ext import ...``, the others stay.
* everything else stays: the CrossEncoder, SparseEncoder and multi-vector losses (st_ext's trainers run
  their cached losses on st_ext's engine), evaluators, samplers, modules, ``import sentence_transformers``.

Only import statements change, and a swapped script swaps to itself. This module reads files with
``ast`` and imports nothing heavy.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

UPSTREAM = "sentence_transformers"
#: Where sentence-transformers 4.x-6.x put their SentenceTransformer losses (``sentence_transformers.losses``
#: is a deprecated alias of the second in 6.x).
LOSS_MODULES = ("sentence_transformers.losses", "sentence_transformers.sentence_transformer.losses")
#: The classes st_ext replaces, which scripts also import from their own modules.
ARCHETYPES = ("SentenceTransformer", "CrossEncoder", "SparseEncoder", "MultiVectorEncoder")
REPLACED_CLASSES = frozenset(
    [*ARCHETYPES, *(name + "Trainer" for name in ARCHETYPES), "SentenceTransformerModelCardData"]
)
#: The one module besides ``sentence_transformers`` whose ``losses`` are st_ext's (the other archetypes' are not).
SENTENCE_TRANSFORMER_PACKAGE = "sentence_transformers.sentence_transformer"
#: Modules of sentence-transformers 4.x-6.x that hold one of :data:`REPLACED_CLASSES`.
CLASS_MODULES = frozenset(
    {
        "sentence_transformers.SentenceTransformer",
        "sentence_transformers.trainer",
        "sentence_transformers.model_card",
        "sentence_transformers.sentence_transformer",
        "sentence_transformers.sentence_transformer.model",
        "sentence_transformers.sentence_transformer.trainer",
        "sentence_transformers.sentence_transformer.model_card",
        "sentence_transformers.cross_encoder",
        "sentence_transformers.cross_encoder.CrossEncoder",
        "sentence_transformers.cross_encoder.model",
        "sentence_transformers.cross_encoder.trainer",
        "sentence_transformers.sparse_encoder",
        "sentence_transformers.sparse_encoder.model",
        "sentence_transformers.sparse_encoder.SparseEncoder",
        "sentence_transformers.sparse_encoder.trainer",
        "sentence_transformers.multi_vector_encoder",
        "sentence_transformers.multi_vector_encoder.model",
        "sentence_transformers.multi_vector_encoder.trainer",
    }
)


def st_ext_names() -> frozenset[str]:
    """Every name ``from st_ext import`` offers, whichever release is installed (st_ext declares them all)."""
    import st_ext

    return frozenset(st_ext._SOURCES) | frozenset(st_ext._SUBMODULES)


@dataclass(frozen=True)
class Edit:
    """Lines ``first``..``last`` (1-based, inclusive) of a file replaced by ``text`` (whole lines)."""

    first: int
    last: int
    text: str


def swapped(source: str, names: frozenset[str] | None = None) -> str:
    """``source`` with its sentence-transformers imports rewritten by the contract; nothing else changes."""
    names = st_ext_names() if names is None else names
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            groups = _regrouped(node.module, node.names, names)
            if groups is not None:
                edits.append(_edit(node, lines, groups))
    for edit in sorted(edits, key=lambda edit: edit.first, reverse=True):
        lines[edit.first - 1 : edit.last] = [edit.text]
    return "".join(lines)


def _regrouped(
    module: str, aliases: list[ast.alias], names: frozenset[str]
) -> list[tuple[str, list[ast.alias]]] | None:
    """The ``(module, names)`` statements one import becomes, or None when it stays as it is."""
    if module in LOSS_MODULES:
        return [("st_ext.losses", aliases)]
    if module == UPSTREAM:
        movable = names
    elif module in CLASS_MODULES:
        movable = REPLACED_CLASSES | ({"losses"} if module == SENTENCE_TRANSFORMER_PACKAGE else set())
    else:
        return None
    moved = [alias for alias in aliases if alias.name in movable]
    if not moved:
        return None
    kept = [alias for alias in aliases if alias.name not in movable]
    return [("st_ext", moved)] + ([(module, kept)] if kept else [])


def _edit(node: ast.ImportFrom, lines: list[str], groups: list[tuple[str, list[ast.alias]]]) -> Edit:
    end_lineno, end_col_offset = node.end_lineno, node.end_col_offset
    assert end_lineno is not None and end_col_offset is not None, "ast.parse gives every statement its end"
    before = lines[node.lineno - 1][: node.col_offset]
    after = lines[end_lineno - 1][end_col_offset:]
    # What shares the statement's lines ("if x: ", a trailing comment, "; other statement") stays around it.
    if before.strip():
        text = before + "; ".join(_statement(module, aliases, "", False) for module, aliases in groups)
    else:
        multiline = end_lineno > node.lineno
        text = "\n".join(_statement(module, aliases, before, multiline) for module, aliases in groups)
    return Edit(node.lineno, end_lineno, text + (after if after.strip() else "\n"))


def _statement(module: str, aliases: list[ast.alias], indent: str, multiline: bool) -> str:
    spelled = [alias.name + (f" as {alias.asname}" if alias.asname else "") for alias in aliases]
    one_line = f"{indent}from {module} import {', '.join(spelled)}"
    if not multiline or len(spelled) == 1:
        return one_line
    inner = indent + "    "
    return f"{indent}from {module} import (\n" + "".join(f"{inner}{name},\n" for name in spelled) + f"{indent})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="st-ext swap-imports",
        description=(
            "Rewrite the sentence-transformers imports of training scripts to st_ext's, by the README's contract "
            "(models, trainers and losses from st_ext; evaluators, samplers and the other archetypes' losses stay). "
            "Only import statements change; running it twice changes nothing more."
        ),
        allow_abbrev=False,
    )
    parser.add_argument("files", nargs="+", metavar="FILE", help="Python scripts to rewrite")
    parser.add_argument(
        "--in-place",
        action="store_true",
        help="write the rewritten scripts back (default: print a unified diff and change nothing)",
    )
    return parser


def run(argv: Sequence[str]) -> int:
    """Print the diff of every file (or write them with ``--in-place``); 2 on a file that cannot be read."""
    args = build_parser().parse_args(list(argv))
    names = st_ext_names()
    for file in args.files:
        path = Path(file)
        try:
            source = path.read_text(encoding="utf-8")
            result = swapped(source, names)
        except (OSError, UnicodeDecodeError) as error:
            print(f"st-ext swap-imports: error: cannot read {file}: {error}", file=sys.stderr)
            return 2
        except SyntaxError as error:
            print(
                f"st-ext swap-imports: error: {file} is not valid Python (line {error.lineno}): {error.msg}",
                file=sys.stderr,
            )
            return 2
        if result == source:
            continue
        if args.in_place:
            path.write_text(result, encoding="utf-8")
            print(f"swapped the imports of {file}")
        else:
            sys.stdout.writelines(
                difflib.unified_diff(
                    source.splitlines(keepends=True), result.splitlines(keepends=True), f"a/{file}", f"b/{file}"
                )
            )
    return 0
