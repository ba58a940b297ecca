"""The pieces of saving an FSDP2-sharded model that run in one process; the 2-rank save itself is in
``tests/test_distributed.py`` (``test_trainer_trains_under_fsdp2_and_saves_a_plain_model``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from st_ext.training.fsdp_saving import full_weights_in_place


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
