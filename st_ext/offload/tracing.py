"""Who holds a live tensor: readable referrer paths, and autograd graphs that saved it.

Holders are traced through the objects Python's garbage collector tracks (attributes, closures,
containers) and through autograd graphs hanging off live tensors; the walks are bounded, because
each step scans the heap.
"""

from __future__ import annotations

import gc
import os
import re
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

_HOLDER_PATHS_LIMIT = 3
_HOLDER_DEPTH_LIMIT = 6
_GRAPH_NODES_LIMIT = 200_000

# Frames of this package are the checker's own (the release and check calls on the stack).
_PACKAGE_DIRECTORY = os.path.dirname(__file__)


def _tensors_sharing_storage(keys: set[tuple[str, int]]) -> tuple[dict, dict]:
    """Live tensors whose storage is one of ``keys``, and the outermost live tensors whose
    autograd graph saved such a storage for backward (an output computed with grad keeps the
    weights it used)."""
    sharing: dict[tuple[str, int], list[torch.Tensor]] = {}
    if not keys:
        return sharing, {}
    live = [obj for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)]  # type(): no __class__ lookups
    for tensor in live:
        key = _storage_key(tensor)
        if key in keys:
            sharing.setdefault(key, []).append(tensor)
    graph_roots = _graph_roots_saving(keys, [tensor for tensor in live if tensor.grad_fn is not None])
    return sharing, graph_roots


def _storage_key(tensor: torch.Tensor) -> tuple[str, int] | None:
    try:
        storage = tensor.untyped_storage()
        return (str(tensor.device), storage.data_ptr()) if storage.nbytes() else None
    except (RuntimeError, NotImplementedError, TypeError):
        return None


@dataclass
class _GraphWalk:
    """State shared by the walks from every live tensor with a ``grad_fn``.

    Each node is walked once and belongs to the first root that reached it. Intermediate tensors
    (hidden states saved for backward) are live tensors too; a root whose ``grad_fn`` another
    root's walk reaches is "covered" by it, so that the graph is reported under its outermost
    tensor, the one user code holds.
    """

    keys: set
    walked_by: dict[int, int] = field(default_factory=dict)
    started_by: dict[int, int] = field(default_factory=dict)
    covered_by: dict[int, int] = field(default_factory=dict)
    kept_nodes: list = field(default_factory=list)  # keeps node ids unique while walking

    def walk(self, root_index: int, start: Any) -> set:
        """Keys among ``keys`` saved in the part of the graph first reached from ``start``."""
        if id(start) in self.walked_by:
            self._cover(self.walked_by[id(start)], over=root_index)
            return set()
        self.started_by[id(start)] = root_index
        found, pending = set(), [start]
        while pending and len(self.kept_nodes) < _GRAPH_NODES_LIMIT:
            node = pending.pop()
            if node is None:
                continue
            if id(node) in self.walked_by:
                other = self.started_by.get(id(node))
                if other is not None and other != root_index:
                    self._cover(root_index, over=other)
                continue
            self.walked_by[id(node)] = root_index
            self.kept_nodes.append(node)
            found.update(key for key in map(_storage_key, _saved_tensors_of(node)) if key in self.keys)
            pending.extend(next_node for next_node, _ in getattr(node, "next_functions", ()))
        return found

    def _cover(self, outer: int, *, over: int) -> None:
        if outer != over:
            self.covered_by.setdefault(over, outer)

    def outermost(self, index: int) -> int:
        for _ in range(len(self.covered_by) + 1):
            if index not in self.covered_by:
                break
            index = self.covered_by[index]
        return index


def _graph_roots_saving(keys: set, roots: list[torch.Tensor]) -> dict[tuple[str, int], list[torch.Tensor]]:
    """For each key, the outermost live tensors whose autograd graph saved that storage."""
    graph = _GraphWalk(keys)
    found_by_root = {index: graph.walk(index, root.grad_fn) for index, root in enumerate(roots)}
    result: dict[tuple[str, int], list[torch.Tensor]] = {}
    for index, found in found_by_root.items():
        outer = roots[graph.outermost(index)]
        for key in found:
            holders = result.setdefault(key, [])
            if not any(holder is outer for holder in holders):
                holders.append(outer)
    return result


def _saved_tensors_of(node: Any) -> Iterator[torch.Tensor]:
    """Tensors an autograd node holds: ``variable`` of AccumulateGrad, ``_saved_*`` of built-in
    nodes, ``saved_tensors`` of custom ``autograd.Function`` nodes (e.g. checkpointing)."""
    variable = getattr(node, "variable", None)
    if isinstance(variable, torch.Tensor):
        yield variable
    for attribute in dir(node):
        if not attribute.startswith("_saved_") and attribute != "saved_tensors":
            continue
        try:
            value = getattr(node, attribute)
        except RuntimeError:  # freed by a backward pass already
            continue
        values = value if isinstance(value, (tuple, list)) else (value,)
        yield from (item for item in values if isinstance(item, torch.Tensor))


def _holder_paths(obj: Any, ignore_ids: set[int]) -> list[str]:
    """Readable paths from named owners down to ``obj``, e.g. ``MyLoss.cached_output`` or
    ``Linear._forward_hooks[3] -> closure variable 'weight' of plant.<locals>.hook()``."""
    paths: list[str] = []
    _climb(obj, [], ignore_ids | {id(paths)}, paths, depth=0)
    return paths


def _climb(obj: Any, labels: list[str], ignore_ids: set[int], paths: list[str], depth: int) -> None:
    """Depth-first search up the referrer graph until a named owner is reached."""
    if depth >= _HOLDER_DEPTH_LIMIT:
        paths.append(_render_path(labels + ["..."]))
        return
    found_before = len(paths)
    referrers = [ref for ref in gc.get_referrers(obj) if _is_foreign(ref, ignore_ids)]
    ignore_ids = ignore_ids | {id(referrers)}
    for referrer in referrers:
        label, next_obj = _step(referrer, obj)
        if label is None:
            continue
        if next_obj is None:
            paths.append(_render_path(labels + [label]))
        else:
            _climb(next_obj, labels + [label], ignore_ids | {id(referrer)}, paths, depth + 1)
        if len(paths) >= _HOLDER_PATHS_LIMIT:
            return
    if len(paths) == found_before and labels:
        # Held by something gc does not track, typically a local variable of a running function.
        paths.append(_render_path(labels + ["<a local variable or C++ state>"]))


def _is_foreign(referrer: Any, ignore_ids: set[int]) -> bool:
    """Not one of the checker's own containers or frames."""
    if id(referrer) in ignore_ids:
        return False
    if isinstance(referrer, types.FrameType) and os.path.dirname(referrer.f_code.co_filename) == _PACKAGE_DIRECTORY:
        return False
    return True


def _step(referrer: Any, child: Any) -> tuple[str | None, Any]:
    """Label for the edge ``referrer -> child``, and the object to keep climbing from (None when
    ``referrer`` names the holder well enough)."""
    if isinstance(referrer, types.FrameType):
        names = [name for name, value in referrer.f_locals.items() if value is child]
        return f"local variable {names[0] if names else '?'!r} of {referrer.f_code.co_name}()", None
    if isinstance(referrer, types.CellType):
        return _closure_step(referrer)
    if isinstance(referrer, dict):
        return _dict_step(referrer, child)
    if isinstance(referrer, (list, tuple)):
        index = next((i for i, item in enumerate(referrer) if item is child), "?")
        return f"[{index}]", referrer
    if isinstance(referrer, (types.FunctionType, types.MethodType)):
        return None, None
    attribute = next((name for name, value in _attributes(referrer) if value is child), None)
    owner = type(referrer).__name__
    return (f"{owner}.{attribute}" if attribute else f"{owner} object"), None


def _closure_step(cell: types.CellType) -> tuple[str | None, Any]:
    for closure in gc.get_referrers(cell):
        if not isinstance(closure, tuple):
            continue
        for function in gc.get_referrers(closure):
            if isinstance(function, types.FunctionType) and function.__closure__ is closure:
                variable = function.__code__.co_freevars[closure.index(cell)]
                return f"closure variable {variable!r} of {function.__qualname__}()", function
    return "closure variable", cell


def _dict_step(mapping: dict, child: Any) -> tuple[str, Any]:
    key = next((key for key, value in mapping.items() if value is child), "?")
    for owner in gc.get_referrers(mapping):
        if _instance_dict(owner) is not mapping:
            continue
        if isinstance(owner, types.ModuleType):
            return f"global {key!r} of module {owner.__name__}", None
        return f"{type(owner).__name__}.{key}", None
    return f"[{key!r}]", mapping


def _instance_dict(obj: Any) -> dict | None:
    """``obj.__dict__`` of an instance or module; None for classes and objects without one."""
    if isinstance(obj, type):
        return None
    try:
        return object.__getattribute__(obj, "__dict__")
    except Exception:
        return None


def _attributes(obj: Any) -> list[tuple[str, Any]]:
    attributes = _instance_dict(obj)
    return list(attributes.items()) if isinstance(attributes, dict) else []


def _render_path(labels_inner_first: list[str]) -> str:
    """Join edge labels from the outermost owner down to the object.

    ``Loss._parameters['weight']`` reads as ``Loss.weight``, as it is written in code.
    """
    text = ""
    for label in reversed(labels_inner_first):
        if not text:
            text = label
        elif label.startswith("["):
            text += label
        else:
            text += " -> " + label
    return re.sub(r"\._(?:parameters|buffers|modules)\[(['\"])(.+?)\1\]", r".\2", text)


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))
