"""What a module holds and what to call it: its tensors by name, and readable descriptions.

Every step reports by name (refusals, release records, leftovers), so naming lives here, apart
from the steps that use it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import nn


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter, buffer and plain tensor attribute of the tree, tied ones under each name."""
    for prefix, submodule in module.named_modules(remove_duplicate=False):
        dotted = f"{prefix}." if prefix else ""
        for name, param in submodule._parameters.items():
            if param is not None:
                yield dotted + name, param
        for name, buffer in submodule._buffers.items():
            if buffer is not None:
                yield dotted + name, buffer
        for name, value in vars(submodule).items():
            if isinstance(value, torch.Tensor):
                yield dotted + name, value


def _tensor_kind(module: nn.Module, name: str) -> str:
    owner_name, _, attribute = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    if attribute in owner._parameters:
        return "parameter"
    if attribute in owner._buffers:
        return "buffer"
    return "tensor attribute"


def name_or_path_of(module: nn.Module) -> str | None:
    """Where the module was loaded from, if a Hugging Face model inside recorded it."""
    for submodule in module.modules():
        for candidate in (
            getattr(submodule, "name_or_path", None),
            getattr(getattr(submodule, "config", None), "_name_or_path", None),
        ):
            if isinstance(candidate, str) and candidate:
                return candidate
    return None


def describe_module(module: nn.Module) -> str:
    """``SentenceTransformer('/path/to/model')``, or the class name when the path is unknown."""
    path = name_or_path_of(module)
    return f"{type(module).__name__}({path!r})" if path else type(module).__name__


def _reload_hint(module: nn.Module) -> str:
    path = name_or_path_of(module)
    if path is None:
        return "Load it again from where it came from to use it (no name_or_path was recorded on it)."
    loader = type(module).__name__ + (".from_pretrained" if hasattr(type(module), "from_pretrained") else "")
    return f"Load it again to use it: {loader}({path!r})."


def _first_names(names: Sequence[str], count: int = 3) -> str:
    shown = ", ".join(repr(name) for name in names[:count])
    return shown + (", ..." if len(names) > count else "")
