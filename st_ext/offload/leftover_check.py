"""The leftover check: which tensors of a released module are still alive, and what holds them.

A single forgotten reference is enough to keep everything. transformers maps a safetensors file
into memory and every parameter's storage points into that one mapping, so one surviving 1.5 KB
bias keeps the whole 90 MB of all-MiniLM-L6-v2 resident. Weak references to every parameter and
buffer (and to their storages), recorded before the release, must be dead afterwards; anything
still alive is reported by name, with what holds it (traced by :mod:`st_ext.offload.tracing`)
and the memory before and after.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from st_ext.offload.errors import LeftoverError
from st_ext.offload.guards import _release_record_of_module
from st_ext.offload.inventory import _named_tensors, _tensor_kind, describe_module
from st_ext.offload.process_memory import _return_freed_memory, read_memory
from st_ext.offload.reports import (
    _TRACED_LEFTOVERS_LIMIT,
    Leftover,
    LeftoverReport,
    ReleaseRecord,
    ReleaseReport,
    _TrackedTensor,
)
from st_ext.offload.tracing import _holder_paths, _tensors_sharing_storage, _unique


def leftovers(target: nn.Module | ReleaseRecord | ReleaseReport) -> LeftoverReport:
    """Every tensor of a released module that is still alive, by name, with what holds it.

    ``target`` is the released module, or the record/report :func:`release` returned (useful once
    the module itself is gone). A tensor counts as alive when its object is, or when its storage
    is (a view, ``.detach()`` or ``.data`` of it survives). Holders are traced through the objects
    Python's garbage collector tracks (attributes, closures, containers) and through autograd
    graphs hanging off live tensors; what only C++ or a running function's locals hold is
    reported as untraced.
    """
    record = _record_of(target)
    _return_freed_memory()
    alive = _alive_tracked(record)
    leftover_list = [
        Leftover(
            name=entry.name + (f" (= {', '.join(entry.aliases)})" if entry.aliases else ""),
            kind=entry.kind,
            nbytes=entry.nbytes,
            device=entry.device,
            how=how,
            held_by=[],
        )
        for entry, how in alive
    ]
    leftover_list += _tensors_back_on_a_device(record)
    if alive:
        _trace_holders(record, alive, leftover_list)
    return LeftoverReport(
        description=record.description,
        tensor_count=len(record.tracked),
        tensor_bytes=record.tensor_bytes,
        leftovers=leftover_list,
        memory_before=record.memory_before,
        memory_after=read_memory(record.devices),
    )


def assert_released(target: nn.Module | ReleaseRecord | ReleaseReport) -> LeftoverReport:
    """Raise :class:`LeftoverError` naming every leftover; return the clean report otherwise."""
    report = leftovers(target)
    if not report.ok:
        raise LeftoverError(str(report))
    return report


def _record_of(target: Any) -> ReleaseRecord:
    if isinstance(target, ReleaseRecord):
        return target
    if isinstance(target, ReleaseReport):
        return target.record
    record = _release_record_of_module(target)
    if record is None:
        raise ValueError(
            f"{describe_module(target) if isinstance(target, nn.Module) else type(target).__name__} "
            "was not released; call st_ext.offload.release() on it first."
        )
    return record


def _alive_tracked(record: ReleaseRecord) -> list[tuple[_TrackedTensor, str]]:
    """Tracked tensors whose object or storage is still alive, with which of the two."""
    alive = []
    for entry in record.tracked:
        if entry.tensor_ref() is not None:
            alive.append((entry, "the tensor object is still referenced"))
        elif entry.storage_ref is not None and entry.storage_ref() is not None:
            alive.append((entry, "its memory is still shared by another live tensor (a view, .detach() or .data)"))
    return alive


def _tensors_back_on_a_device(record: ReleaseRecord) -> list[Leftover]:
    """Tensors that are in the released module again and not on ``meta`` (assigned afterwards)."""
    module = record.module_ref()
    if module is None:
        return []
    return [
        Leftover(
            name=name,
            kind=_tensor_kind(module, name),
            nbytes=tensor.numel() * tensor.element_size(),
            device=str(tensor.device),
            how=f"it is in the released module, on {tensor.device} (assigned after the release)",
            held_by=[record.description],
        )
        for name, tensor in _named_tensors(module)
        if not tensor.is_meta
    ]


def _trace_holders(record: ReleaseRecord, alive: list[tuple[_TrackedTensor, str]], found: list[Leftover]) -> None:
    """Fill ``held_by`` of the first leftovers (tracing is one heap scan per step, so bounded)."""
    keys = {entry.storage_key for entry, _ in alive if entry.storage_key is not None}
    sharing, graph_roots = _tensors_sharing_storage(keys)
    own_containers = {id(sharing), id(graph_roots), *map(id, sharing.values()), *map(id, graph_roots.values())}
    described: dict[int, list[str]] = {}

    def holders_of(obj: Any) -> list[str]:
        if id(obj) not in described:
            described[id(obj)] = _holder_paths(obj, own_containers | {id(described)})
        return described[id(obj)]

    for index, (entry, _how) in enumerate(alive):
        if index >= _TRACED_LEFTOVERS_LIMIT:
            found[index].held_by = [f"not traced (only the first {_TRACED_LEFTOVERS_LIMIT} leftovers are)"]
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
        found[index].held_by = _unique(held_by) or [
            "nothing Python's gc tracks (a local variable of a running function, or C++ state)"
        ]
