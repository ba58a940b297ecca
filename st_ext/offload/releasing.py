"""Releasing a module for good: :func:`release` and every reference it clears.

"Moving it to CPU and emptying the cache" looks like a release and frees nothing: every reference
that would keep the old tensors alive has to go.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, MutableMapping
from typing import Any

import torch
from torch import nn

from st_ext._compat import clear_module_hooks, own_buffers, own_parameters, own_submodules
from st_ext.offload.guards import install_release_guard, refuse_if_released, refuse_if_trainable
from st_ext.offload.leftover_check import leftovers
from st_ext.offload.placement import remove_accelerate_hooks
from st_ext.offload.process_memory import glibc_malloc_trim, return_freed_memory
from st_ext.offload.records import ReleaseRecord, ReleaseReport, named_tensors

logger = logging.getLogger(__name__)

#: Where st_ext keeps the DeepSpeed engine it gave a frozen encoder (:mod:`st_ext.training.zero3_encoders`).
DEEPSPEED_ENGINE_ATTRIBUTE = "_st_ext_zero3_engine"


def release(
    module: nn.Module,
    *,
    holders: Iterable[Any] = (),
    optimizers: Iterable[Any] = (),
    force: bool = False,
    check: bool = True,
) -> ReleaseReport:
    """Free ``module`` for good and return what was done, with a leftover check.

    References on ``holders`` (an object's attributes, or a mapping's values, that are the module, a
    submodule, one of its tensors or a bound method of one) are set to None, its parameters and their
    state leave ``optimizers``, its hooks (accelerate's included) and gradients are dropped and its
    tensors become ``meta`` tensors; then freed memory is handed back (gc, the CUDA cache,
    ``malloc_trim``). The module object stays, near-empty, so that code still holding it gets a
    :class:`ReleasedModuleError` rather than an AttributeError.
    """
    refuse_if_released(module)
    refuse_if_trainable(module, optimizers=optimizers, force=force, action="release")
    record = ReleaseRecord.of(module)
    cleared = _clear_holder_references(holders, module)
    cleared += _drop_from_optimizers(optimizers, module)
    accelerate_hooks_removed = remove_accelerate_hooks(module)
    # ZeRO-3's parameter coordinator, and with it each rank's slice of the weights, stays referenced
    # from what zero.Init and the engine left on the submodules until the engine is destroyed.
    engine = module.__dict__.pop(DEEPSPEED_ENGINE_ATTRIBUTE, None)
    if engine is not None:
        engine.destroy()
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
        malloc_trimmed=glibc_malloc_trim() is not None,
        check=check_report,
    )
    logger.info("%s", report)
    return report


def _clear_holder_references(holders: Iterable[Any], module: nn.Module) -> list[str]:
    """Set to None every entry of ``holders`` that is part of ``module`` or a bound method of a part.

    An entry is an attribute (for an ``nn.Module`` holder, a submodule, parameter or buffer too) or a
    mapping's value. Only direct entries: a list or dict inside a holder may be shared with code that
    expects it unchanged, so pass such a mapping itself as a holder to have it cleared.
    """
    family = {id(submodule) for submodule in module.modules()} | {id(tensor) for _, tensor in named_tensors(module)}
    cleared = []
    for holder in holders:
        if id(holder) in family:
            continue
        if isinstance(holder, MutableMapping):
            registries, label = [holder], "{}[{!r}]"
        else:
            registries, label = [getattr(holder, "__dict__", {})], "{}.{}"
            if isinstance(holder, nn.Module):
                registries = [own_submodules(holder), own_parameters(holder), own_buffers(holder), *registries]
        for registry in registries:
            for key, value in list(registry.items()):
                if id(value) in family or id(getattr(value, "__self__", None)) in family:
                    registry[key] = None
                    cleared.append(label.format(type(holder).__name__, key))
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
        for registry in (own_parameters(submodule), own_buffers(submodule), vars(submodule)):
            for name, tensor in list(registry.items()):
                if isinstance(tensor, torch.Tensor):
                    if isinstance(tensor, nn.Parameter):
                        tensor.grad = None
                    registry[name] = meta_of(tensor)
