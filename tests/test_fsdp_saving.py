"""The pieces of saving an FSDP2-sharded model that run in one process; the 2-rank save itself is in
``tests/test_distributed.py`` (``test_trainer_trains_under_fsdp2_and_saves_a_plain_model``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from st_ext.training.fsdp_saving import fsdp_hooks_held_back, full_weights_in_place


def small_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    model[1].register_buffer("scratch", torch.zeros(1), persistent=False)
    return model


def whole_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: torch.full_like(tensor, 7.0) for name, tensor in model.state_dict().items()}


def test_the_whole_tensors_stand_in_while_saving_and_the_own_come_back():
    model = small_model()
    own = dict(model.named_parameters())
    given = whole_tensors(model)
    with full_weights_in_place(model, given):
        inside = model.state_dict()
        assert all(torch.equal(inside[name], given[name]) for name in given)
        assert isinstance(model[0].weight, nn.Parameter)
    assert all(model.get_parameter(name) is param for name, param in own.items())
    assert model[1].scratch.shape == (1,), "a non-persistent buffer is not the state dict's to replace"


def test_the_own_tensors_come_back_after_an_error():
    model = small_model()
    own = model[0].weight
    with pytest.raises(RuntimeError, match="disk full"):
        with full_weights_in_place(model, whole_tensors(model)):
            raise RuntimeError("disk full")
    assert model[0].weight is own


def test_a_partial_state_dict_is_refused_naming_what_it_lacks():
    model = small_model()
    partial = whole_tensors(model)
    del partial["0.bias"]
    with pytest.raises(ValueError, match=r"lacks 1 of the model's tensors \(0\.bias.*FULL_STATE_DICT"):
        with full_weights_in_place(model, partial):
            pass
    assert not torch.equal(model[0].weight, torch.full_like(model[0].weight, 7.0))


def test_keys_are_the_state_dicts_through_checkpointing_wrappers():
    """accelerate's ``fsdp_activation_checkpointing`` wraps layers; ``get_model_state_dict`` names their
    tensors without the wrapper, as ``state_dict()`` does."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = small_model()
    model[0] = checkpoint_wrapper(model[0])
    given = whole_tensors(model)
    assert "0.weight" in given
    with full_weights_in_place(model, given):
        assert torch.equal(model[0]._checkpoint_wrapped_module.weight, given["0.weight"])


def test_buffers_left_out_of_the_state_dict_join_the_whole_tensors_device():
    """The Trainer gathers onto the CPU while a GPU model's unsaved buffers stay on the GPU; "meta"
    stands for the other device here."""
    model = small_model()
    given = {name: torch.empty_like(tensor, device="meta") for name, tensor in model.state_dict().items()}
    with full_weights_in_place(model, given):
        assert model[1].scratch.device.type == "meta"
    assert model[1].scratch.device.type == "cpu"


def fsdp_like(function):
    """A hook that ``fsdp_hooks_held_back`` takes for FSDP2's, which it tells by the defining module."""
    function.__module__ = "torch.distributed.fsdp._fully_shard._fsdp_state"
    return function


def test_fsdp_hooks_are_held_back_and_come_back_in_place():
    model = nn.Linear(2, 2)
    fsdp_hook = model.register_forward_pre_hook(fsdp_like(lambda module, args: None), prepend=True)
    own_hook = model.register_forward_pre_hook(lambda module, args: None)
    dropped_hook = model.register_forward_pre_hook(lambda module, args: None)
    with fsdp_hooks_held_back(model):
        assert list(model._forward_pre_hooks) == [own_hook.id, dropped_hook.id]
        dropped_hook.remove()
        added_hook = model.register_forward_pre_hook(lambda module, args: None)
    assert list(model._forward_pre_hooks) == [fsdp_hook.id, own_hook.id, added_hook.id]
