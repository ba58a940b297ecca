"""Saving a model that FSDP2 shards, so that the saved files hold its whole weights.

Under FSDP with ``state_dict_type: FULL_STATE_DICT`` the Hugging Face Trainer gathers the whole state
dict onto the first rank and hands it to ``_save``. sentence-transformers' ``_save`` ignores it and saves
the model object, whose parameters are each rank's shard (DTensors), and the save fails ("Attempted to
access the data pointer on an invalid python storage"). The sharded model's modules are the only ones
that know how to save themselves (each module writes its own files and config), so the gathered
tensors are put in place of the shards while the model saves, then the shards are put back.

FSDP2's module hooks are held back meanwhile: its state-dict pre-hook would put the shards back, and
its forward hooks would gather parameters (a collective) when the model card encodes its usage
example, which only the saving rank runs.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Iterator, Mapping

import torch
from torch import nn

#: The hook dictionaries FSDP2 registers in, by what they would undo or run while a model saves.
_FSDP_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_state_dict_pre_hooks")


def _is_fsdp_hook(hook: Any) -> bool:
    function = getattr(hook, "func", hook)  # functools.partial
    return (getattr(function, "__module__", None) or "").startswith("torch.distributed.fsdp")


@contextmanager
def fsdp_hooks_held_back(model: nn.Module) -> Iterator[None]:
    """Inside the block, ``model``'s modules run without FSDP2's hooks; every other hook stays, and
    afterwards every hook is where it was in its dictionary (FSDP2 puts its forward pre-hook first)."""
    held = []
    for module in model.modules():
        for attribute in _FSDP_HOOK_DICTS:
            hooks = getattr(module, attribute)
            if any(_is_fsdp_hook(hook) for hook in hooks.values()):
                held.append((hooks, list(hooks.items())))
                for hook_id in [hook_id for hook_id, hook in hooks.items() if _is_fsdp_hook(hook)]:
                    del hooks[hook_id]
    try:
        yield
    finally:
        for hooks, before in held:
            added = [(hook_id, hook) for hook_id, hook in hooks.items() if hook_id not in dict(before)]
            hooks.clear()
            hooks.update(before + added)


@contextmanager
def whole_model_for_saving(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Inside the block, ``model`` is the whole model of ``state_dict`` and runs on the saving rank alone."""
    with ExitStack() as stack:
        stack.enter_context(fsdp_hooks_held_back(model))
        stack.enter_context(full_weights_in_place(model, state_dict))
        yield


@contextmanager
def full_weights_in_place(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Inside the block, ``model``'s parameters and buffers are the whole tensors of ``state_dict`` (as
    ``get_model_state_dict(..., full_state_dict=True)`` names them); afterwards, its own again.

    Every parameter and persistent buffer must be in ``state_dict``: a partial one would save a model
    mixing whole tensors with shards, so it raises ``ValueError`` naming what is missing.
    """
    slots = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for store in (module._parameters, module._buffers):
            for name, tensor in store.items():
                if tensor is None or (store is module._buffers and name in module._non_persistent_buffers_set):
                    continue
                slots.setdefault(prefix + name, []).append((store, name, tensor))
    missing = sorted(set(slots) - set(state_dict))
    if missing:
        raise ValueError(
            f"The gathered state dict lacks {len(missing)} of the model's tensors ({', '.join(missing[:3])}, ...): "
            "saving would mix whole tensors with this rank's shards. Save with FSDP's "
            "state_dict_type FULL_STATE_DICT, which gathers every tensor."
        )
    try:
        for key, places in slots.items():
            for store, name, tensor in places:
                whole = state_dict[key]
                store[name] = nn.Parameter(whole, requires_grad=False) if isinstance(tensor, nn.Parameter) else whole
        yield
    finally:
        for places in slots.values():
            for store, name, tensor in places:
                store[name] = tensor
