"""Releasing a module for good: :func:`release` and everything it clears.

Parameters and buffers become ``meta`` tensors, and every reference that would keep the old ones
alive is dropped: gradients, accelerate hooks, a DeepSpeed engine st_ext attached, forward/backward
hooks, attributes of the objects passed as ``holders``, optimizer entries. Then freed memory is
handed back and the leftover check runs. "Moving it to CPU and emptying the cache" looks like a
release and frees nothing.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, MutableMapping
from typing import Any

import torch
from torch import nn

from st_ext._compat import clear_module_hooks, own_buffers, own_parameters, own_submodules
from st_ext.offload.guards import install_release_guard, refuse_if_released, refuse_if_trainable
from st_ext.offload.leftover_check import leftovers
from st_ext.offload.placement import remove_accelerate_hooks
from st_ext.offload.process_memory import can_trim_c_heap, read_memory, return_freed_memory
from st_ext.offload.records import (
    ReleaseRecord,
    ReleaseReport,
    TrackedTensor,
    describe_module,
    named_tensors,
    reload_hint,
    storage_key,
    tensor_kind,
)

logger = logging.getLogger(__name__)


def release(
    module: nn.Module,
    *,
    holders: Iterable[Any] = (),
    optimizers: Iterable[Any] = (),
    force: bool = False,
    check: bool = True,
) -> ReleaseReport:
    """Free ``module`` for good and return what was done, with a leftover check.

    In order: record weak references to every tensor; clear references on ``holders`` (each
    object's attributes, or a mapping's values, that are the module, a submodule, one of its
    tensors or a bound method of one of them are set to None); drop its parameters from
    ``optimizers`` (with their state); remove accelerate and forward/backward/state-dict hooks
    from every submodule; drop ``.grad``; replace parameters, buffers and tensor attributes by
    ``meta`` tensors of the same shape; install a guard that makes any call raise
    :class:`ReleasedModuleError`; then ``gc.collect()``, ``torch.cuda.empty_cache()`` and
    ``malloc_trim(0)``.

    The module object itself stays valid (near-empty) so that code still holding it gets a clear
    error rather than an AttributeError.
    """
    refuse_if_released(module)
    refuse_if_trainable(module, optimizers=optimizers, force=force, action="release")
    record = _record_before_release(module)
    cleared = _clear_holder_references(holders, module)
    cleared += _drop_from_optimizers(optimizers, module)
    accelerate_hooks_removed = remove_accelerate_hooks(module)
    _destroy_attached_engine(module)
    # A hook closure is the usual hiding place of a reference to a parameter or an output.
    module_hooks_removed = sum(clear_module_hooks(submodule) for submodule in module.modules())
    _replace_tensors_with_meta(module)
    install_release_guard(module, record)
    if check:
        check_report = leftovers(record)  # frees first: gc, empty_cache, malloc_trim
    else:
        check_report = None
        return_freed_memory()
    report = ReleaseReport(
        record=record,
        cleared=cleared,
        module_hooks_removed=module_hooks_removed,
        accelerate_hooks_removed=accelerate_hooks_removed,
        malloc_trimmed=can_trim_c_heap(),
        check=check_report,
    )
    logger.info("%s", report)
    return report


#: Where st_ext keeps the DeepSpeed engine it gave a frozen encoder (:mod:`st_ext.training.zero3_encoders`).
DEEPSPEED_ENGINE_ATTRIBUTE = "_st_ext_zero3_engine"


def _destroy_attached_engine(module: nn.Module) -> None:
    """Destroy the DeepSpeed engine st_ext attached to ``module``, so that its hooks go with the module.

    ZeRO-3's parameter coordinator stays referenced from what ``zero.Init`` and the engine left on the
    submodules, and with it each rank's slice of the weights: the leftover check names them.
    """
    engine = module.__dict__.pop(DEEPSPEED_ENGINE_ATTRIBUTE, None)
    if engine is not None:
        engine.destroy()


def _storage_weakref(tensor: torch.Tensor) -> tuple[weakref.ref | None, tuple[str, int] | None]:
    """A weak reference to the tensor's storage and its (device, address), where torch allows it.

    The storage outlives the tensor object when a view, ``.detach()`` or ``.data`` of it is alive,
    so watching only the tensor would miss those.
    """
    key = storage_key(tensor)
    try:
        return weakref.ref(tensor.untyped_storage()), key
    except (RuntimeError, NotImplementedError, TypeError):
        return None, key


def _record_before_release(module: nn.Module) -> ReleaseRecord:
    """Weak references to every distinct tensor of ``module``, and the memory figures before."""
    by_id: dict[int, TrackedTensor] = {}
    for name, tensor in named_tensors(module):
        if id(tensor) in by_id:
            by_id[id(tensor)].aliases.append(name)
            continue
        storage_ref, key = _storage_weakref(tensor)
        by_id[id(tensor)] = TrackedTensor(
            name=name,
            aliases=[],
            kind=tensor_kind(module, name),
            nbytes=tensor.numel() * tensor.element_size(),
            device=str(tensor.device),
            tensor_ref=weakref.ref(tensor),
            storage_ref=storage_ref,
            storage_key=key,
        )
    tracked = [entry for entry in by_id.values() if entry.device != "meta"]
    devices = {entry.device for entry in tracked}
    return ReleaseRecord(
        description=describe_module(module),
        reload_hint=reload_hint(module),
        tracked=tracked,
        memory_before=read_memory(devices),
        module_ref=weakref.ref(module),
    )


def _module_family(module: nn.Module) -> dict[int, str]:
    """Ids of the module, its submodules and its tensors, mapped to a name for reports."""
    family = {id(submodule): (name or "<module>") for name, submodule in module.named_modules()}
    for name, tensor in named_tensors(module):
        family.setdefault(id(tensor), name)
    return family


def _points_into(value: Any, family: dict[int, str]) -> bool:
    """Whether ``value`` is part of the released module, or a bound method of a part of it."""
    return id(value) in family or id(getattr(value, "__self__", None)) in family


def _clear_holder_references(holders: Iterable[Any], module: nn.Module) -> list[str]:
    """Set to None every attribute (or mapping value) of ``holders`` that points into ``module``.

    Only direct attributes are cleared: a list or dict inside a holder may be shared with code
    that expects it unchanged, so pass such a mapping itself as a holder to have it cleared.
    """
    family = _module_family(module)
    cleared = []
    for holder in holders:
        if id(holder) in family:
            continue
        holder_name = type(holder).__name__
        if isinstance(holder, MutableMapping):
            for key, value in list(holder.items()):
                if _points_into(value, family):
                    holder[key] = None
                    cleared.append(f"{holder_name}[{key!r}]")
            continue
        if isinstance(holder, nn.Module):
            cleared += _clear_module_holder(holder, family)
        for name, value in list(getattr(holder, "__dict__", {}).items()):
            if _points_into(value, family):
                holder.__dict__[name] = None
                cleared.append(f"{holder_name}.{name}")
    return cleared


def _clear_module_holder(holder: nn.Module, family: dict[int, str]) -> list[str]:
    """Clear submodule, parameter and buffer entries of an ``nn.Module`` holder (e.g. a loss)."""
    cleared = []
    for entries in (own_submodules(holder), own_parameters(holder), own_buffers(holder)):
        for name, value in list(entries.items()):
            if value is not None and _points_into(value, family):
                entries[name] = None
                cleared.append(f"{type(holder).__name__}.{name}")
    return cleared


def _drop_from_optimizers(optimizers: Iterable[Any], module: nn.Module) -> list[str]:
    """Remove the module's parameters, and their state, from each optimizer (only with force)."""
    parameter_ids = {id(param) for param in module.parameters()}
    cleared = []
    for optimizer in optimizers:
        dropped = 0
        for group in getattr(optimizer, "param_groups", ()):
            kept = [param for param in group["params"] if id(param) not in parameter_ids]
            dropped += len(group["params"]) - len(kept)
            group["params"] = kept
        state = getattr(optimizer, "state", {})
        for param in [param for param in state if id(param) in parameter_ids]:
            del state[param]
        if dropped:
            cleared.append(f"{type(optimizer).__name__}: {dropped} parameters and their state")
    return cleared


def _replace_tensors_with_meta(module: nn.Module) -> None:
    """Replace every parameter, buffer and tensor attribute by a new ``meta`` tensor.

    New objects rather than ``param.data = meta``: the old tensor objects must die, so that the
    weak references recorded before can prove it. Tied tensors stay tied.
    """
    replacements: dict[int, torch.Tensor] = {}

    def meta_of(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in replacements:
            empty = torch.empty_like(tensor, device="meta")
            if isinstance(tensor, nn.Parameter):
                empty = nn.Parameter(empty, requires_grad=tensor.requires_grad)
            replacements[id(tensor)] = empty
        return replacements[id(tensor)]

    for submodule in module.modules():
        for registry in (own_parameters(submodule), own_buffers(submodule)):
            for name, tensor in list(registry.items()):
                if tensor is not None:
                    if isinstance(tensor, nn.Parameter):
                        tensor.grad = None
                    registry[name] = meta_of(tensor)
        for name, value in list(vars(submodule).items()):
            if isinstance(value, torch.Tensor):
                submodule.__dict__[name] = meta_of(value)
