"""Checks on input, and the guard a released module carries.

Offloading or releasing a module that is being trained (a parameter that requires grad, or one in
an optimizer passed in) is refused unless ``force=True``: moving it would silently break training.
A released module carries its :class:`~st_ext.offload.ReleaseRecord` and forward pre-hooks that
raise :class:`~st_ext.offload.ReleasedModuleError`, so that using it again fails clearly.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from st_ext.offload.errors import ReleasedModuleError, TrainableModuleError
from st_ext.offload.inventory import _first_names, describe_module
from st_ext.offload.reports import ReleaseRecord

_RECORD_ATTRIBUTE = "_st_ext_release_record"


def refuse_if_trainable(
    module: nn.Module,
    *,
    optimizers: Iterable[Any] = (),
    force: bool = False,
    action: str = "offload",
) -> None:
    """Raise :class:`TrainableModuleError` if ``module`` is being trained, unless ``force``.

    "Being trained" means a parameter requires grad or is in one of ``optimizers``: moving its
    weights would leave an optimizer (or its state) on another device, and releasing them would
    destroy what is being learnt.
    """
    if force:
        return
    requiring_grad = [name for name, param in module.named_parameters() if param.requires_grad]
    optimized_ids = _parameter_ids_in(optimizers)
    in_optimizer = [name for name, param in module.named_parameters() if id(param) in optimized_ids]
    if not requiring_grad and not in_optimizer:
        return
    reasons = []
    if requiring_grad:
        reasons.append(f"{len(requiring_grad)} parameters require grad (e.g. {_first_names(requiring_grad)})")
    if in_optimizer:
        reasons.append(f"{len(in_optimizer)} parameters are in an optimizer you passed (e.g. {_first_names(in_optimizer)})")
    raise TrainableModuleError(
        f"Refusing to {action} {describe_module(module)}: it is being trained: {'; '.join(reasons)}. "
        "A frozen encoder (guide, teacher) does not need gradients: freeze it with "
        "`module.requires_grad_(False)` and keep it out of the optimizer, or pass force=True to "
        f"{action} it anyway."
    )


def refuse_if_released(module: nn.Module) -> None:
    """Raise :class:`ReleasedModuleError` if ``module`` was released by :func:`release`."""
    record = _release_record_of_module(module)
    if record is not None:
        raise ReleasedModuleError(record.released_message())


def is_released(module: nn.Module) -> bool:
    """Whether :func:`release` was called on ``module`` (and :func:`remove_release_guard` was not)."""
    return _release_record_of_module(module) is not None


def _parameter_ids_in(optimizers: Iterable[Any]) -> set[int]:
    """Ids of every parameter in the ``param_groups`` of the given optimizers."""
    ids = set()
    for optimizer in optimizers:
        for group in getattr(optimizer, "param_groups", ()):
            ids.update(id(param) for param in group["params"])
    return ids


def _install_release_guard(module: nn.Module, record: ReleaseRecord) -> None:
    """Make every call of the module or of any submodule raise :class:`ReleasedModuleError`.

    On every submodule, not just the root: ``SentenceTransformer.encode`` calls ``self.forward``
    directly, which skips the root's hooks but not those of the modules it calls.
    """
    message = record.released_message()

    def refuse_released(_module, _args):
        raise ReleasedModuleError(message)

    for submodule in module.modules():
        record.guard_handles.append(submodule.register_forward_pre_hook(refuse_released))
    module.__dict__[_RECORD_ATTRIBUTE] = record


def remove_release_guard(module: nn.Module) -> None:
    """Undo the guard of :func:`release`, e.g. before loading weights into the empty skeleton with
    ``module.to_empty(device=...)`` and ``load_state_dict``."""
    record = module.__dict__.pop(_RECORD_ATTRIBUTE, None)
    if record is not None:
        for handle in record.guard_handles:
            handle.remove()
        record.guard_handles.clear()


def _release_record_of_module(module: Any) -> ReleaseRecord | None:
    return getattr(module, "__dict__", {}).get(_RECORD_ATTRIBUTE)
