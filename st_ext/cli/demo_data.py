"""The built-in training data: standard-library function names paired with their docstring summaries.

Every Python install has it offline, it is text written by people, and it makes a retrieval task with
a clear answer (``"os path join"`` -> the summary of ``os.path.join``). It is deterministic for a given
Python version: modules in a fixed order, members sorted by name, duplicate summaries dropped.
"""

from __future__ import annotations

import importlib
import inspect

MODULES = tuple(
    """
    os os.path shutil pathlib glob fnmatch string textwrap re difflib json csv base64 binascii hashlib
    zlib gzip bz2 lzma tarfile zipfile math cmath statistics random decimal fractions itertools
    functools operator collections heapq bisect copy pprint datetime calendar time locale inspect types
    typing contextlib abc warnings traceback logging argparse urllib.parse html email.utils ipaddress
    socket select subprocess threading queue sched tempfile filecmp stat platform sys unicodedata codecs
    struct array weakref gc dis ast tokenize keyword builtins io pickle shelve sqlite3 uuid secrets hmac
    mimetypes colorsys wave doctest unittest
    """.split()
)


def _summary(obj) -> str | None:
    doc = inspect.getdoc(obj)
    if not doc:
        return None
    first = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
    # Signature-only first lines (C builtins) say nothing a name does not.
    if first.endswith(")") and "(" in first.split(" ")[0] or len(first) < 15:
        return None
    return first[:300]


def stdlib_pairs() -> list[dict[str, str]]:
    """``{"anchor": "<module> <name> (words)", "positive": "<summary>"}`` for stdlib callables."""
    pairs, seen = [], set()
    for module_name in MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name, member in sorted(vars(module).items()):
            if name.startswith("_") or not callable(member) or inspect.ismodule(member):
                continue
            summary = _summary(member)
            if summary is None or summary in seen:
                continue
            seen.add(summary)
            query = f"{module_name} {name}".replace(".", " ").replace("_", " ")
            pairs.append({"anchor": query, "positive": summary})
    return pairs
