"""Where a frozen module's tensors live: :func:`offload`, :func:`onload` and :func:`on_device`.

A frozen encoder only needs the accelerator for its own forward pass; these move it there and away
again, keeping its parameter objects so that optimizers and holders see the same tensors.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from st_ext._compat import (
    can_swap_parameter_data,
    clear_placement_cache,
    has_accelerate_hook,
    own_buffers,
    own_parameters,
)
from st_ext.offload.guards import DispatchedModuleError, refuse_if_released, refuse_if_trainable
from st_ext.offload.records import describe_module, first_names, named_tensors

logger = logging.getLogger(__name__)


def offload(
    module: nn.Module,
    device: str | torch.device = "cpu",
    *,
    optimizers: Iterable[Any] = (),
    force: bool = False,
) -> nn.Module:
    """Move a frozen ``module`` off the accelerator (to ``device``, CPU by default); returns it.

    accelerate hooks (a ``device_map`` dispatch) are removed first, because they would move inputs
    back to the devices of the map on the next forward. The module keeps its parameter objects,
    so an optimizer or a loss that holds them still sees the same tensors.
    """
    return _ready_to_move(module, optimizers, force, "offload").to(device)


def onload(
    module: nn.Module,
    device: str | torch.device,
    *,
    optimizers: Iterable[Any] = (),
    force: bool = False,
) -> nn.Module:
    """Move a frozen, offloaded ``module`` back onto ``device``; returns it. See :func:`offload`."""
    return _ready_to_move(module, optimizers, force, "onload").to(device)


def _ready_to_move(module: nn.Module, optimizers: Iterable[Any], force: bool, action: str) -> nn.Module:
    refuse_if_released(module)
    refuse_if_trainable(module, optimizers=optimizers, force=force, action=action)
    _remove_accelerate_hooks_for_move(module)
    return module


@contextlib.contextmanager
def on_device(
    module: nn.Module,
    device: str | torch.device,
    *,
    optimizers: Iterable[Any] = (),
    force: bool = False,
) -> Iterator[nn.Module]:
    """Put ``module`` on ``device`` for the ``with`` block, then every tensor back where it was.

    >>> with on_device(guide, "cuda"):
    ...     guide_embeddings = guide.encode(texts, convert_to_tensor=True)

    The original tensors are swapped back in rather than copied back: a frozen module's weights do
    not change on the device, so leaving costs no transfer and the module ends up with exactly the
    storages it had. With ``force=True`` (a trainable module) the values are copied back into them.
    """
    _ready_to_move(module, optimizers, force, "move")
    moved = _move_tensors_keeping_originals(module, torch.device(device))
    try:
        yield module
    finally:
        _put_back_originals(moved, copy_back=force)


@dataclass
class _MovedTensor:
    """``registry[name]`` moved by :func:`on_device`: ``original`` is its former ``.data`` when only the
    data was swapped (the parameter object stayed), else the former tensor object, replaced in ``registry``."""

    registry: dict
    name: str
    original: torch.Tensor
    object_replaced: bool


def _move_tensors_keeping_originals(module: nn.Module, device: torch.device) -> list[_MovedTensor]:
    """Move every parameter and buffer to ``device``; return the originals to restore later.

    A parameter keeps its identity where torch allows it (only ``.data`` changes, as with
    ``nn.Module.to`` between CPU and CUDA); on devices whose tensors cannot back an existing
    parameter (``meta``) a new parameter stands in for the block. Shared tensors stay shared.
    """
    moved: list[_MovedTensor] = []
    stand_in_of: dict[int, torch.Tensor] = {}
    for owner in module.modules():
        for registry, is_parameter in ((own_parameters(owner), True), (own_buffers(owner), False)):
            for name, tensor in list(registry.items()):
                if tensor is None:
                    continue
                if id(tensor) not in stand_in_of:
                    stand_in_of[id(tensor)] = _move_one(tensor, device, is_parameter, registry, name, moved)
                elif stand_in_of[id(tensor)] is not tensor:
                    registry[name] = stand_in_of[id(tensor)]
                    moved.append(_MovedTensor(registry, name, tensor, object_replaced=True))
    return moved


def _move_one(tensor, device, is_parameter, registry, name, moved) -> torch.Tensor:
    """Move one tensor; record how to undo it in ``moved``; return what now stands in its place."""
    data = tensor.data
    copy = data.to(device)
    if copy is data:
        return tensor
    if is_parameter and can_swap_parameter_data(tensor, copy):
        _swap_parameter_data(tensor, copy)
        moved.append(_MovedTensor(registry, name, data, object_replaced=False))
        return tensor
    registry[name] = nn.Parameter(copy, requires_grad=tensor.requires_grad) if is_parameter else copy
    moved.append(_MovedTensor(registry, name, tensor, object_replaced=True))
    return registry[name]


@torch.no_grad()
def _put_back_originals(moved: list[_MovedTensor], *, copy_back: bool) -> None:
    """Undo :func:`_move_tensors_keeping_originals`, copying values back first when asked."""
    for entry in reversed(moved):
        current = entry.registry[entry.name]
        if copy_back and current is not None and current.shape == entry.original.shape:
            entry.original.data.copy_(current.data)
        if entry.object_replaced:
            entry.registry[entry.name] = entry.original
        else:
            _swap_parameter_data(current, entry.original)


def _swap_parameter_data(param: torch.Tensor, data: torch.Tensor) -> None:
    """Point ``param`` at ``data``; a gradient follows it, since it must live on the same device."""
    grad, param.grad = param.grad, None
    param.data = data
    if grad is not None:
        param.grad = grad.to(data.device)


# --------------------------------------------------------------------------- accelerate hooks
# Hooks left by a device_map dispatch would move inputs back to the devices of the map; with cpu/disk
# offload they hold the weights themselves.


def _accelerate_hooked_modules(module: nn.Module) -> list[str]:
    return [name or "<root>" for name, submodule in module.named_modules() if has_accelerate_hook(submodule)]


def remove_accelerate_hooks(module: nn.Module) -> bool:
    """Remove accelerate hooks from the whole tree; whether there were any.

    A placement hook a model caches (sentence-transformers 6's ``_accelerate_placement_hook``) is
    forgotten too: it would keep its offloaded weights alive and its device authoritative.
    """
    if not _accelerate_hooked_modules(module):
        return False
    from accelerate.hooks import remove_hook_from_module

    remove_hook_from_module(module, recurse=True)
    for submodule in module.modules():
        clear_placement_cache(submodule)
    return True


def _remove_accelerate_hooks_for_move(module: nn.Module) -> None:
    """Remove accelerate hooks before a move, or refuse when they hold the weights (cpu/disk offload:
    the parameters are ``meta`` placeholders, and removing the hooks would lose them)."""
    hooked = _accelerate_hooked_modules(module)
    if not hooked:
        return
    on_meta = [name for name, tensor in named_tensors(module) if tensor.is_meta]
    if on_meta:
        raise DispatchedModuleError(
            f"Cannot move {describe_module(module)}: accelerate hooks on {first_names(hooked)} hold its "
            f"weights ({len(on_meta)} tensors are 'meta' placeholders, e.g. {first_names(on_meta)}), as after "
            "a device_map with 'cpu'/'disk' offload or accelerate.cpu_offload(). accelerate already "
            "moves them onto the execution device for each forward; use the module as it is, or load "
            "it without offload (no device_map) to manage it with st_ext.offload."
        )
    remove_accelerate_hooks(module)
    logger.info("Removed accelerate hooks from %s before moving it.", describe_module(module))
