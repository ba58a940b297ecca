"""The refusals of st_ext.offload: its exceptions, and the checks and guard that raise them.

A module being trained (a parameter that requires grad, or one in an optimizer passed in) is not
moved or released unless ``force=True``: that would silently break training. A released module
raises :class:`ReleasedModuleError` when used again. Callers catch :class:`OffloadError` for any refusal.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from st_ext.offload.records import ReleaseRecord, describe_module, first_names

_RECORD_ATTRIBUTE = "_st_ext_release_record"


class OffloadError(RuntimeError):
    """Base class of the errors st_ext.offload raises."""


class TrainableModuleError(OffloadError):
    """The module is being trained; moving or releasing it would break training."""


class ReleasedModuleError(OffloadError):
    """The module was released: its weights are gone and it cannot run."""


class DispatchedModuleError(OffloadError):
    """accelerate owns the module's weights (cpu/disk offload), so they cannot be moved here."""


class LeftoverError(AssertionError):
    """Something of a released module is still alive; raised by :func:`assert_released`, which is meant for tests."""


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
    groups = [group for optimizer in optimizers for group in getattr(optimizer, "param_groups", ())]
    optimized_ids = {id(param) for group in groups for param in group["params"]}
    requiring_grad = [name for name, param in module.named_parameters() if param.requires_grad]
    in_optimizer = [name for name, param in module.named_parameters() if id(param) in optimized_ids]
    reasons = [
        f"{len(names)} parameters {what} (e.g. {first_names(names)})"
        for names, what in ((requiring_grad, "require grad"), (in_optimizer, "are in an optimizer you passed"))
        if names
    ]
    if reasons:
        raise TrainableModuleError(
            f"Refusing to {action} {describe_module(module)}: it is being trained: {'; '.join(reasons)}. "
            "A frozen encoder (guide, teacher) does not need gradients: freeze it with "
            "`module.requires_grad_(False)` and keep it out of the optimizer, or pass force=True to "
            f"{action} it anyway."
        )


def refuse_if_released(module: nn.Module) -> None:
    """Raise :class:`ReleasedModuleError` if ``module`` was released by :func:`release`."""
    record = release_record_of(module)
    if record is not None:
        raise ReleasedModuleError(record.released_message())


def is_released(module: nn.Module) -> bool:
    """Whether :func:`release` was called on ``module`` (and :func:`remove_release_guard` was not)."""
    return release_record_of(module) is not None


#: Methods of the released module that would read its meta weights: saving would fail half-way with
#: torch's meta-tensor error and leave a half-written folder, moving with the same error.
GUARDED_METHODS = ("save", "save_pretrained", "save_to_hub", "push_to_hub", "to", "cuda", "cpu")


def install_release_guard(module: nn.Module, record: ReleaseRecord) -> None:
    """Make calling the module or any submodule, or its :data:`GUARDED_METHODS`, raise :class:`ReleasedModuleError`.

    Every submodule, not just the root: ``SentenceTransformer.encode`` calls ``self.forward``
    directly, which skips the root's hooks but not those of the modules it calls.
    """
    message = record.released_message()

    def refuse_released(*_args, **_kwargs):
        raise ReleasedModuleError(message)

    for submodule in module.modules():
        record.guard_handles.append(submodule.register_forward_pre_hook(refuse_released))
    for name in GUARDED_METHODS:
        if hasattr(module, name):
            module.__dict__[name] = refuse_released
    module.__dict__[_RECORD_ATTRIBUTE] = record


def remove_release_guard(module: nn.Module) -> None:
    """Undo the guard of :func:`release`, e.g. before loading weights into the empty skeleton with
    ``module.to_empty(device=...)`` and ``load_state_dict``."""
    record = module.__dict__.pop(_RECORD_ATTRIBUTE, None)
    if record is not None:
        for name in GUARDED_METHODS:
            module.__dict__.pop(name, None)
        for handle in record.guard_handles:
            handle.remove()
        record.guard_handles.clear()


def release_record_of(module: Any) -> ReleaseRecord | None:
    """The record :func:`release` left on ``module``, or None when it was not released."""
    return getattr(module, "__dict__", {}).get(_RECORD_ATTRIBUTE)
