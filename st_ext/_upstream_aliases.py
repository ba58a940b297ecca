"""Upstream's module paths under st_ext's name: ``import st_ext.evaluation``, ``from st_ext.models import Pooling``.

Upstream's paths change between releases (5.4 and 6.0 moved most modules and left deprecated paths behind), so
instead of one st_ext file per upstream module, a meta path finder (installed by ``st_ext/__init__.py``; this
module imports only the standard library, so ``import st_ext`` stays cheap) answers ``st_ext.<path>`` with:

* upstream's module object itself, so that ``isinstance``, ``monkeypatch`` and module state are shared;
* or, where that module offers an object st_ext replaces (``sentence_transformers.cross_encoder`` offers
  ``CrossEncoder``) and its parent is st_ext's own, a thin st_ext module that reads through to upstream's and
  answers st_ext's object for those names. Below a module that is upstream's own, paths stay upstream's, so an
  attribute and an import of the same path always agree.

A path with a file in st_ext (``st_ext.losses``, ``st_ext.models``) is never aliased; the upstream paths below it
that st_ext lacks are (``st_ext.losses.MatryoshkaLoss``). The import system binds every loaded submodule on its
parent; where the parent is upstream's, or answers that name with something that is not a module
(``sentence_transformers.SentenceTransformer`` is a module path and the class), that binding is dropped, so
importing an st_ext path never changes what upstream's modules or st_ext's names hold.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import os
import re
import sys
import warnings
from types import ModuleType
from typing import Any

PACKAGE = "st_ext"
UPSTREAM = "sentence_transformers"
#: What :func:`resolve` answers for a name upstream does not have.
MISSING = object()


def upstream_path(name: str) -> str:
    """``st_ext.evaluation`` -> ``sentence_transformers.evaluation``."""
    return UPSTREAM + name[len(PACKAGE) :]


_replacements: dict[int, tuple[Any, Any]] | None = None


def _replacement_of(value: Any) -> Any:
    """st_ext's object where ``value`` is upstream's object that st_ext replaces, else ``value``. The replacements
    come from st_ext's two declarations: ``st_ext._SOURCES`` and ``st_ext.losses.ST_EXT_LOSSES``."""
    global _replacements
    if _replacements is None:
        st_ext = sys.modules[PACKAGE]
        upstream = importlib.import_module(UPSTREAM)
        pairs = [
            (getattr(upstream, name), getattr(st_ext, name))
            for name, source in st_ext._SOURCES.items()
            if source != UPSTREAM and hasattr(upstream, name)
        ]
        losses = importlib.import_module(f"{PACKAGE}.losses")
        upstream_losses = importlib.import_module(f"{PACKAGE}._compat").st_losses()
        pairs += [
            (getattr(upstream_losses, name), getattr(losses, name))
            for name in losses.ST_EXT_LOSSES
            if hasattr(upstream_losses, name)
        ]
        _replacements = {id(theirs): (theirs, ours) for theirs, ours in pairs}
    entry = _replacements.get(id(value))
    return entry[1] if entry is not None and entry[0] is value else value


def resolve(name: str, upstream: ModuleType, attribute: str) -> Any:
    """``attribute`` of st_ext's module ``name``, read from upstream's ``upstream``: a submodule as st_ext's module
    of the same path, an object st_ext replaces as st_ext's, anything else as upstream's; :data:`MISSING` where
    upstream has no such attribute (so that an error while loading st_ext's object is not taken for that)."""
    value = getattr(upstream, attribute, MISSING)
    if value is MISSING:
        return MISSING
    if isinstance(value, ModuleType) and sys.modules.get(f"{upstream_path(name)}.{attribute}") is value:
        return importlib.import_module(f"{name}.{attribute}")
    return _replacement_of(value)


def offered(module: ModuleType) -> list[Any]:
    """The objects of ``module``'s ``__all__``, else those it defines (not those it imports)."""
    names = getattr(module, "__all__", None)
    if names is not None:
        return [getattr(module, name, None) for name in names]
    return [value for value in list(vars(module).values()) if getattr(value, "__module__", None) == module.__name__]


def _owned(module: ModuleType, name: str) -> bool:
    """Whether ``module``, imported as ``name``, is st_ext's own (a file of st_ext or a read-through module)."""
    return getattr(module, "__name__", None) == name


def _read_through(name: str, upstream: ModuleType) -> ModuleType:
    """A module named ``name`` that answers every attribute of ``upstream`` through :func:`resolve`."""
    module = ModuleType(name, upstream.__doc__)

    def __getattr__(attribute: str) -> Any:
        value = resolve(name, upstream, attribute)
        if value is MISSING:
            raise AttributeError(f"module {name!r} has no attribute {attribute!r}")
        return value

    def __dir__() -> list[str]:
        return sorted({*dir(upstream), *vars(module)})

    module.__getattr__ = __getattr__
    module.__dir__ = __dir__
    if hasattr(upstream, "__path__"):
        module.__path__ = []  # a package whose submodules come from this finder, never from upstream's files
    return module


_dropped: dict[int, set[str]] = {}
_keeping_classes: dict[type, type] = {}


def _drop_binding(parent: ModuleType, attribute: str) -> None:
    """Have the import system's coming ``setattr(parent, attribute, submodule)`` ignored: ``parent`` turns into a
    subclass of its module class that ignores it, and back once every announced binding has come."""
    _dropped.setdefault(id(parent), set()).add(attribute)
    base = type(parent)
    if base in _keeping_classes.values():
        return
    if base not in _keeping_classes:

        def __setattr__(self, attribute: str, value: Any) -> None:
            names = _dropped.get(id(self))
            if names is not None and attribute in names and isinstance(value, ModuleType):
                names.discard(attribute)
                if not names:
                    del _dropped[id(self)]
                    ModuleType.__setattr__(self, "__class__", base)
                return
            base.__setattr__(self, attribute, value)

        _keeping_classes[base] = type(f"_Keeping{base.__name__}", (base,), {"__setattr__": __setattr__})
    parent.__class__ = _keeping_classes[base]


class _AliasLoader(importlib.abc.Loader):
    """Hands the import system a module that already exists, without executing anything."""

    def __init__(self, name: str, module: ModuleType) -> None:
        self.name = name
        self.module = module
        # The import system points the module's __spec__ at the alias spec; upstream's module keeps its own.
        self.original_spec = None if _owned(module, name) else module.__spec__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self.module

    def exec_module(self, module: ModuleType) -> None:
        if self.original_spec is not None:
            module.__spec__ = self.original_spec
        parent_name, _, attribute = self.name.rpartition(".")
        parent = sys.modules[parent_name]
        if not _owned(parent, parent_name):
            _drop_binding(parent, attribute)
            return
        current = vars(parent).get(attribute, MISSING)
        if current is MISSING:
            upstream_parent = sys.modules.get(upstream_path(parent_name))
            current = MISSING if upstream_parent is None else vars(upstream_parent).get(attribute, MISSING)
        if current is not MISSING and not isinstance(current, ModuleType):
            _drop_binding(parent, attribute)


_IMPORTLIB_DIR = os.path.dirname(importlib.__file__)


def _importer_frame():
    """The frame of the code that imports an st_ext path: the first outside the import machinery and this module."""
    frame = inspect.currentframe().f_back
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename != __file__ and not filename.startswith(("<frozen importlib", _IMPORTLIB_DIR)):
            return frame
        frame = frame.f_back
    return None


def _import_upstream(name: str) -> ModuleType:
    """Import upstream's module ``name``. Upstream (5.4+) warns of a deprecated path at the first frame outside its
    machinery, which is this module's; that warning is told again at the importer's line with st_ext's paths, as
    upstream's own import would show it. Its warnings about the parent paths are dropped (the importer imported
    those through st_ext already, and ``st_ext.models`` is not deprecated); other warnings pass through."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.filterwarnings("always", category=DeprecationWarning, module=re.escape(__name__))
        module = importlib.import_module(name)
    frame = _importer_frame()
    for warning in caught:
        if warning.filename == __file__:
            if frame is None or f"'{name}'" not in str(warning.message):
                continue
            message = str(warning.message).replace(f"'{UPSTREAM}.", f"'{PACKAGE}.")
            registry = frame.f_globals.setdefault("__warningregistry__", {})
            module_name = frame.f_globals.get("__name__", "")
            warnings.warn_explicit(
                message, warning.category, frame.f_code.co_filename, frame.f_lineno, module_name, registry
            )
        else:
            warnings.showwarning(
                warning.message, warning.category, warning.filename, warning.lineno, warning.file, warning.line
            )
    return module


class UpstreamFinder(importlib.abc.MetaPathFinder):
    """Finds ``st_ext.<path>`` as ``sentence_transformers.<path>`` where st_ext has no file for it."""

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None):
        if not fullname.startswith(PACKAGE + "."):
            return None
        parent_name = fullname.rpartition(".")[0]
        parent = sys.modules.get(parent_name)
        if parent is None:
            return None
        parent_owned = _owned(parent, parent_name)
        spec = vars(parent).get("__spec__")
        has_files = spec is not None and spec.submodule_search_locations and not isinstance(spec.loader, _AliasLoader)
        if parent_owned and has_files and importlib.machinery.PathFinder.find_spec(fullname, path) is not None:
            return None  # st_ext's own file: the regular finders load it
        target_name = upstream_path(fullname)
        try:
            upstream = _import_upstream(target_name)
        except ModuleNotFoundError as error:
            if error.name and (target_name + ".").startswith(error.name + "."):
                return None  # upstream has no such module either
            raise  # an optional dependency of upstream's module is missing: say so, as upstream would
        module = upstream
        if parent_owned and any(_replacement_of(value) is not value for value in offered(upstream)):
            module = _read_through(fullname, upstream)
        return importlib.util.spec_from_loader(
            fullname, _AliasLoader(fullname, module), is_package=hasattr(upstream, "__path__")
        )


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once): the path finder would load upstream's files a second time."""
    if not any(isinstance(finder, UpstreamFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, UpstreamFinder())
