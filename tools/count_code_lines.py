"""Lines of code in st_ext's library: every line holding a token of code, docstrings, comments and blank lines
excluded (read with ``ast`` and ``tokenize``, so formatting alone never changes the figure).

    python tools/count_code_lines.py                 # st_ext/ without the command line (st_ext/cli/)
    python tools/count_code_lines.py --with-cli
    python tools/count_code_lines.py --root /path/to/other/checkout/st_ext
"""

from __future__ import annotations

import argparse
import ast
import io
import tokenize
from pathlib import Path

#: Tokens that are not code by themselves.
NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


def docstring_lines(tree: ast.AST) -> set[int]:
    """The lines of every module, class and function docstring."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def code_lines(source: str) -> int:
    """How many lines of ``source`` hold code."""
    docstrings = docstring_lines(ast.parse(source))
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in NOT_CODE:
            lines.update(line for line in range(token.start[0], token.end[0] + 1) if line not in docstrings)
    return len(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1] / "st_ext")
    parser.add_argument("--with-cli", action="store_true", help="count st_ext/cli/ too")
    options = parser.parse_args()
    files = sorted(
        path
        for path in options.root.rglob("*.py")
        if options.with_cli or "cli" not in path.relative_to(options.root).parts
    )
    counts = {path.relative_to(options.root): code_lines(path.read_text(encoding="utf-8")) for path in files}
    for path, count in counts.items():
        print(f"{count:6d}  {path}")
    print(f"{sum(counts.values()):6d}  in {len(counts)} files")


if __name__ == "__main__":
    main()
