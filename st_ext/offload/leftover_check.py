"""The leftover check: which tensors of a released module are still alive, and what holds them.

One forgotten reference is enough to keep everything: transformers maps a safetensors file into
memory and every parameter's storage points into that one mapping, so one surviving 1.5 KB bias
keeps the whole 90 MB of all-MiniLM-L6-v2 resident. Holders are traced through the objects Python's
garbage collector tracks and through autograd graphs hanging off live tensors; the walks are
bounded, because each step scans the heap.
"""

from __future__ import annotations

import gc
import re
import types
from typing import Any

import torch
from torch import nn

from st_ext._compat import autograd_node_tensors
from st_ext.offload.guards import LeftoverError, release_record_of
from st_ext.offload.process_memory import read_memory, return_freed_memory
from st_ext.offload.records import (
    TRACED_LEFTOVERS_LIMIT,
    Leftover,
    LeftoverReport,
    ReleaseRecord,
    ReleaseReport,
    TrackedTensor,
    describe_module,
    named_tensors,
    storage_key,
    tensor_kind,
)

_HOLDER_PATHS_LIMIT = 3
_HOLDER_DEPTH_LIMIT = 6
_GRAPH_NODES_LIMIT = 200_000


def leftovers(target: nn.Module | ReleaseRecord | ReleaseReport) -> LeftoverReport:
    """Every tensor of a released module that is still alive, by name, with what holds it.

    ``target`` is the released module, or the record/report :func:`release` returned (useful once
    the module itself is gone). A tensor counts as alive when its object is, or when its storage
    is (a view, ``.detach()`` or ``.data`` of it survives). Holders are traced through attributes,
    closures, containers and autograd graphs; what only C++ or a running function's locals hold is
    reported as untraced.
    """
    if isinstance(target, ReleaseReport):
        target = target.record
    record = target if isinstance(target, ReleaseRecord) else release_record_of(target)
    if record is None:
        raise ValueError(
            f"{describe_module(target) if isinstance(target, nn.Module) else type(target).__name__} "
            "was not released; call st_ext.offload.release() on it first."
        )
    return_freed_memory()
    alive, found = [], []
    for entry in record.tracked:
        if entry.tensor_ref() is not None:
            how = "the tensor object is still referenced"
        elif entry.storage_ref is not None and entry.storage_ref() is not None:
            how = "its memory is still shared by another live tensor (a view, .detach() or .data)"
        else:
            continue
        alive.append(entry)
        name = entry.name + (f" (= {', '.join(entry.aliases)})" if entry.aliases else "")
        found.append(Leftover(name, entry.kind, entry.nbytes, entry.device, how, held_by=[]))
    module = record.module_ref()
    if module is not None:
        for name, tensor in named_tensors(module):
            if not tensor.is_meta:
                found.append(
                    Leftover(
                        name=name,
                        kind=tensor_kind(module, name),
                        nbytes=tensor.numel() * tensor.element_size(),
                        device=str(tensor.device),
                        how=f"it is in the released module, on {tensor.device} (assigned after the release)",
                        held_by=[record.description],
                    )
                )
    _trace_holders(alive, found)
    return LeftoverReport(
        description=record.description,
        tensor_count=len(record.tracked),
        tensor_bytes=record.tensor_bytes,
        leftovers=found,
        memory_before=record.memory_before,
        memory_after=read_memory(record.devices),
    )


def assert_released(target: nn.Module | ReleaseRecord | ReleaseReport) -> LeftoverReport:
    """Raise :class:`LeftoverError` naming every leftover; return the clean report otherwise."""
    report = leftovers(target)
    if not report.ok:
        raise LeftoverError(str(report))
    return report


def _trace_holders(alive: list[TrackedTensor], found: list[Leftover]) -> None:
    """Fill ``held_by`` of the first leftovers, which are ``alive`` in order."""
    keys = {entry.storage_key for entry in alive if entry.storage_key is not None}
    sharing, graph_roots = _tensors_sharing_storage(keys)
    own_containers = {id(sharing), id(graph_roots), *map(id, sharing.values()), *map(id, graph_roots.values())}
    described: dict[int, list[str]] = {}

    def holders_of(obj: Any) -> list[str]:
        if id(obj) not in described:
            paths: list[str] = []
            _climb(obj, [], own_containers | {id(described), id(paths)}, paths, depth=0)
            described[id(obj)] = paths
        return described[id(obj)]

    for index, entry in enumerate(alive):
        if index >= TRACED_LEFTOVERS_LIMIT:
            found[index].held_by = [f"not traced (only the first {TRACED_LEFTOVERS_LIMIT} leftovers are)"]
            continue
        held_by: list[str] = []
        tensor = entry.tensor_ref()
        if tensor is not None:
            held_by += holders_of(tensor)
        for other in sharing.get(entry.storage_key, []):
            if other is not tensor:
                held_by += [f"{path} (a tensor sharing its memory)" for path in holders_of(other)]
        for root in graph_roots.get(entry.storage_key, []):
            shape = tuple(root.shape)
            held_by += [
                f"{path} (the autograd graph of this tensor of shape {shape} saved it for backward)"
                for path in holders_of(root) or ["an untraced reference"]
            ]
        del tensor
        found[index].held_by = list(dict.fromkeys(held_by)) or [
            "nothing Python's gc tracks (a local variable of a running function, or C++ state)"
        ]


def _tensors_sharing_storage(keys: set[tuple[str, int]]) -> tuple[dict, dict]:
    """Live tensors whose storage is one of ``keys``, and the outermost live tensors whose
    autograd graph saved such a storage for backward (an output computed with grad keeps the
    weights it used)."""
    sharing: dict[tuple[str, int], list[torch.Tensor]] = {}
    if not keys:
        return sharing, {}
    live = [obj for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)]  # type(): no __class__ lookups
    for tensor in live:
        key = storage_key(tensor)
        if key in keys:
            sharing.setdefault(key, []).append(tensor)
    return sharing, _graph_roots_saving(keys, [tensor for tensor in live if tensor.grad_fn is not None])


def _graph_roots_saving(keys: set, roots: list[torch.Tensor]) -> dict[tuple[str, int], list[torch.Tensor]]:
    """For each key, the outermost live tensors whose autograd graph saved that storage.

    Each node is walked once and belongs to the first root that reached it. Intermediate tensors
    (hidden states saved for backward) are live roots too; a root whose ``grad_fn`` another root's
    walk reaches is covered by it, so that a graph is reported under the tensor user code holds.
    """
    walked_by: dict[int, int] = {}
    started_by: dict[int, int] = {}
    covered_by: dict[int, int] = {}
    kept_nodes: list = []  # keeps node ids unique while walking
    found_by_root: dict[int, set] = {}
    for index, root in enumerate(roots):
        found = found_by_root[index] = set()
        start = root.grad_fn
        if id(start) in walked_by:
            covered_by.setdefault(index, walked_by[id(start)])
            continue
        started_by[id(start)] = index
        pending = [start]
        while pending and len(kept_nodes) < _GRAPH_NODES_LIMIT:
            node = pending.pop()
            if node is None:
                continue
            if id(node) in walked_by:
                other = started_by.get(id(node))
                if other is not None and other != index:
                    covered_by.setdefault(other, index)
                continue
            walked_by[id(node)] = index
            kept_nodes.append(node)
            found.update(key for key in map(storage_key, autograd_node_tensors(node)) if key in keys)
            pending.extend(next_node for next_node, _ in getattr(node, "next_functions", ()))
    result: dict[tuple[str, int], list[torch.Tensor]] = {}
    for index, found in found_by_root.items():
        outer = index
        for _ in range(len(covered_by) + 1):  # bounded: covering never cycles, but a cap costs nothing
            if outer not in covered_by:
                break
            outer = covered_by[outer]
        for key in found:
            holders = result.setdefault(key, [])
            if not any(holder is roots[outer] for holder in holders):
                holders.append(roots[outer])
    return result


def _climb(obj: Any, labels: list[str], ignore_ids: set[int], paths: list[str], depth: int) -> None:
    """Add to ``paths`` readable paths from named owners down to ``obj``, e.g. ``MyLoss.cached_output`` or
    ``Linear._forward_hooks[3] -> closure variable 'weight' of plant.<locals>.hook()``: a depth-first
    search up the referrer graph, passing over frames (the checker's own hold what it inspects)."""
    if depth >= _HOLDER_DEPTH_LIMIT:
        paths.append(_render_path(labels + ["..."]))
        return
    found_before = len(paths)
    referrers = [
        ref for ref in gc.get_referrers(obj) if id(ref) not in ignore_ids and not isinstance(ref, types.FrameType)
    ]
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
    if len(paths) == found_before and labels:  # something gc does not track holds it
        paths.append(_render_path(labels + ["<a local variable or C++ state>"]))


def _step(referrer: Any, child: Any) -> tuple[str | None, Any]:
    """Label for the edge ``referrer -> child``, and the object to keep climbing from (None when
    ``referrer`` names the holder well enough)."""
    if isinstance(referrer, types.CellType):
        return _closure_step(referrer)
    if isinstance(referrer, (dict, tuple)) and (default := _default_argument_step(referrer, child)):
        return default
    if isinstance(referrer, (dict, list, tuple)):
        return _container_step(referrer, child)
    if isinstance(referrer, (types.FunctionType, types.MethodType)):
        return None, None
    attributes = _instance_dict(referrer)
    items = attributes.items() if isinstance(attributes, dict) else ()
    attribute = next((name for name, value in items if value is child), None)
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


def _default_argument_step(defaults: tuple | dict, child: Any) -> tuple[str, Any] | None:
    """``default argument 'w' of f()`` when ``defaults`` is a function's ``__defaults__`` (or
    ``__kwdefaults__``), as in ``lambda module, args, w=weight: ...``; climbs on from the function."""
    for function in gc.get_referrers(defaults):
        if not isinstance(function, types.FunctionType):
            continue
        if function.__defaults__ is defaults:
            code = function.__code__
            names = code.co_varnames[: code.co_argcount]
            index = next(index for index, value in enumerate(defaults) if value is child)
            return (
                f"default argument {names[len(names) - len(defaults) + index]!r} of {function.__qualname__}()",
                function,
            )
        if function.__kwdefaults__ is defaults:
            name = next(key for key, value in defaults.items() if value is child)
            return f"default argument {name!r} of {function.__qualname__}()", function
    return None


def _container_step(container: dict | list | tuple, child: Any) -> tuple[str, Any]:
    """``Owner.key`` when ``container`` is an object's ``__dict__``, else ``[key]`` and climb on."""
    items = container.items() if isinstance(container, dict) else enumerate(container)
    key = next((key for key, value in items if value is child), "?")
    if isinstance(container, dict):
        for owner in gc.get_referrers(container):
            if _instance_dict(owner) is container:
                return f"{type(owner).__name__}.{key}", None
    return (f"[{key!r}]" if isinstance(container, dict) else f"[{key}]"), container


def _instance_dict(obj: Any) -> dict | None:
    """``obj.__dict__`` of an instance or module; None for classes and objects without one."""
    if isinstance(obj, type):
        return None
    try:
        return object.__getattribute__(obj, "__dict__")
    except Exception:
        return None


def _render_path(labels_inner_first: list[str]) -> str:
    """Edge labels joined from the outermost owner down; ``Loss._parameters['weight']`` reads ``Loss.weight``."""
    text = ""
    for label in reversed(labels_inner_first):
        text += label if not text or label.startswith("[") else " -> " + label
    return re.sub(r"\._(?:parameters|buffers|modules)\[(['\"])(.+?)\1\]", r".\2", text)
