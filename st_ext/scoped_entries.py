"""Setting entries of a mapping for the length of a block: the one set-and-restore of flags and
environment variables that the trainers and the distributed engines' gradient reductions use."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any


@contextmanager
def entries_set(mapping: MutableMapping, entries: Mapping[str, Any]) -> Iterator[None]:
    """``mapping`` (``os.environ``, an object's ``vars``) holds ``entries`` inside the block; afterwards each key
    is as it was before, absent where it was absent."""
    missing = object()
    before = {key: mapping.get(key, missing) for key in entries}
    mapping.update(entries)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is missing:
                mapping.pop(key, None)
            else:
                mapping[key] = value
