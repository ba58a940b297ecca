"""st_ext: sentence-transformers training that fits in memory.

Swap the import and keep the training script::

    from st_ext import SentenceTransformer, CrossEncoder, SentenceTransformerTrainer, CrossEncoderTrainer, losses

``SparseEncoder`` (sentence-transformers 5.0+) and ``MultiVectorEncoder`` (6.0+), with their trainers and
training arguments, are here where the installed release has them. Every other public name and module path of
the installed sentence-transformers answers here as upstream's object (see :mod:`st_ext._upstream_aliases`).
Names load on first use, so that ``st-ext --help`` answers without importing torch.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _distribution_version

from st_ext import _upstream_aliases

_upstream_aliases.install()

try:
    #: The installed distribution's version (pyproject.toml is the one place it is written).
    __version__ = _distribution_version("st-ext")
except _PackageNotFoundError:  # a source tree on sys.path without `pip install -e .`
    __version__ = "0+unknown"

_ARCHETYPES = ("SentenceTransformer", "CrossEncoder", "SparseEncoder", "MultiVectorEncoder")
#: Each public name and the module it comes from: st_ext's models and trainers, upstream's argument classes.
_SOURCES = {
    **{archetype: "st_ext.models" for archetype in _ARCHETYPES},
    **{archetype + "Trainer": "st_ext.training.trainer" for archetype in _ARCHETYPES},
    **{archetype + "TrainingArguments": "sentence_transformers" for archetype in _ARCHETYPES},
}


def _public_names() -> list[str]:
    from st_ext import _compat

    ours = {name for name in _SOURCES if _compat.missing_archetype_error(name) is None}
    return sorted(ours | set(importlib.import_module("sentence_transformers").__all__)) + ["__version__"]


def __getattr__(name: str):
    """Load a public name on first use: st_ext's own, else upstream's (a submodule as ``st_ext.<name>``)."""
    if name == "__all__":
        return _public_names()
    if name in _SOURCES:
        from st_ext import _compat

        error = _compat.missing_archetype_error(name)
        if error is not None:
            raise error
        value = getattr(importlib.import_module(_SOURCES[name]), name)
        globals()[name] = value
        return value
    if not name.startswith("_"):
        value = _upstream_aliases.resolve(__name__, importlib.import_module("sentence_transformers"), name)
        if value is not _upstream_aliases.MISSING:
            return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    upstream = importlib.import_module("sentence_transformers")
    return sorted({*globals(), *_public_names(), *(name for name in dir(upstream) if not name.startswith("_"))})
