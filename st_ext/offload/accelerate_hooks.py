"""accelerate's dispatch hooks: finding them, and removing them before a move or a release.

Hooks left by a ``device_map`` dispatch would move inputs back to the devices of the map, and
with cpu/disk offload they hold the weights themselves, which then cannot be moved here.
"""

from __future__ import annotations

import logging

from torch import nn

from st_ext.offload.errors import DispatchedModuleError
from st_ext.offload.inventory import _first_names, _named_tensors, describe_module

logger = logging.getLogger(__name__)


def _accelerate_hooked_modules(module: nn.Module) -> list[str]:
    """Names of submodules carrying accelerate hooks (``_hf_hook`` or a replaced forward)."""
    return [
        name or "<root>"
        for name, submodule in module.named_modules()
        if hasattr(submodule, "_hf_hook") or hasattr(submodule, "_old_forward")
    ]


def _remove_accelerate_hooks(module: nn.Module) -> bool:
    """Remove accelerate hooks from the whole tree; whether there were any.

    Models that cache their placement hook (sentence-transformers 6 keeps it in
    ``_accelerate_placement_hook`` and offers ``clear_placement_cache``) are told to forget it;
    otherwise the cached hook would keep its offloaded weights alive and its device authoritative.
    """
    if not _accelerate_hooked_modules(module):
        return False
    from accelerate.hooks import remove_hook_from_module

    remove_hook_from_module(module, recurse=True)
    for submodule in module.modules():
        clear_placement_cache = getattr(submodule, "clear_placement_cache", None)
        if callable(clear_placement_cache):
            clear_placement_cache()
    return True


def _remove_accelerate_hooks_for_move(module: nn.Module) -> None:
    """Remove accelerate hooks before a move, or explain why the module cannot be moved.

    With cpu/disk offload (``device_map`` with "cpu"/"disk", ``cpu_offload()``) the parameters are
    ``meta`` placeholders and the weights live inside the hooks; removing the hooks would lose them.
    """
    hooked = _accelerate_hooked_modules(module)
    if not hooked:
        return
    on_meta = [name for name, tensor in _named_tensors(module) if tensor.is_meta]
    if on_meta:
        raise DispatchedModuleError(
            f"Cannot move {describe_module(module)}: accelerate hooks on {_first_names(hooked)} hold its "
            f"weights ({len(on_meta)} tensors are 'meta' placeholders, e.g. {_first_names(on_meta)}), as after "
            "a device_map with 'cpu'/'disk' offload or accelerate.cpu_offload(). accelerate already "
            "moves them onto the execution device for each forward; use the module as it is, or load "
            "it without offload (no device_map) to manage it with st_ext.offload."
        )
    _remove_accelerate_hooks(module)
    logger.info("Removed accelerate hooks from %s before moving it.", describe_module(module))
