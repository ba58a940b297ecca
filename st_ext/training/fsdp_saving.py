"""Saving a model that FSDP2 shards, so that the saved files hold its whole weights.

Under FSDP with ``state_dict_type: FULL_STATE_DICT`` the Hugging Face Trainer gathers the whole state dict onto
the first rank and hands it to ``_save``. sentence-transformers' ``_save`` ignores it and saves the model object,
whose parameters are each rank's shard (DTensors), and fails ("Attempted to access the data pointer on an invalid
python storage"). Only the model's modules know how to save themselves, so the gathered tensors stand in for the
shards while the model saves. FSDP2's hooks are held back meanwhile: its state-dict pre-hook would put the shards
back, and its forward hooks would gather parameters (a collective) when the model card encodes its usage example,
which only the saving rank runs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from itertools import chain

import torch
from torch import nn

from st_ext._compat import (
    fsdp_hook_dicts,
    is_fsdp2_hook,
    non_persistent_buffer_names,
    own_buffers,
    own_parameters,
    state_dict_key_prefix,
)


@contextmanager
def fsdp_hooks_held_back(model: nn.Module) -> Iterator[None]:
    """Inside the block, ``model``'s modules run without FSDP2's hooks; every other hook stays. Each
    FSDP2 hook goes back to its place in its dictionary (FSDP2 puts its forward pre-hook first)."""
    held = []
    for module in model.modules():
        for hooks in fsdp_hook_dicts(module):
            removed = {hook_id: hook for hook_id, hook in hooks.items() if is_fsdp2_hook(hook)}
            if removed:
                held.append((hooks, list(hooks), removed))
                for hook_id in removed:
                    del hooks[hook_id]
    try:
        yield
    finally:
        for hooks, order, removed in held:
            merged = {**hooks, **removed}  # hooks added inside the block follow the original order
            hooks.clear()
            hooks.update((hook_id, merged.pop(hook_id)) for hook_id in order if hook_id in merged)
            hooks.update(merged)


@contextmanager
def full_weights_in_place(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Inside the block, ``model``'s parameters and buffers are the whole tensors of ``state_dict`` (as
    ``get_model_state_dict(..., full_state_dict=True)`` names them); afterwards, its own again.

    A ``state_dict`` missing a parameter or persistent buffer raises ``ValueError`` (the save would mix whole
    tensors with shards). Non-persistent buffers (BERT's ``position_ids``) move to the whole tensors' device
    meanwhile: the Trainer gathers onto the CPU, and the model card's example must run there.
    """
    slots: dict[str, list[tuple[dict, str, torch.Tensor]]] = {}
    unsaved = []
    for module_name, module in model.named_modules():
        prefix = state_dict_key_prefix(module_name)
        buffers = own_buffers(module)
        for store in (own_parameters(module), buffers):
            for name, tensor in store.items():
                if tensor is None:
                    continue
                if store is buffers and name in non_persistent_buffer_names(module):
                    unsaved.append((store, name, tensor))
                else:
                    slots.setdefault(prefix + name, []).append((store, name, tensor))
    missing = sorted(set(slots) - set(state_dict))
    if missing:
        raise ValueError(
            f"The gathered state dict lacks {len(missing)} of the model's tensors ({', '.join(missing[:3])}, ...): "
            "saving would mix whole tensors with this rank's shards. Save with FSDP's "
            "state_dict_type FULL_STATE_DICT, which gathers every tensor."
        )
    device = next((tensor.device for tensor in state_dict.values()), None)
    try:
        for key, places in slots.items():
            for store, name, tensor in places:
                whole = state_dict[key]
                store[name] = nn.Parameter(whole, requires_grad=False) if isinstance(tensor, nn.Parameter) else whole
        for store, name, tensor in unsaved:
            store[name] = tensor.to(device) if device is not None else tensor
        yield
    finally:
        for store, name, tensor in chain(*slots.values(), unsaved):
            store[name] = tensor
