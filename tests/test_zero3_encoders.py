"""Which modules of a loss get an engine of their own under ZeRO-3: frozen ones that zero.Init partitioned
and that are not the model being trained. (Training with such a guide: tests/test_distributed.py.)"""

from __future__ import annotations

import pytest
from torch import nn

from st_ext.training.zero3_encoders import frozen_encoder_config, partitioned_frozen_encoders


def partitioned(module: nn.Module) -> nn.Module:
    """Mark ``module``'s parameters as zero.Init marks the ones it split across ranks."""
    for index, param in enumerate(module.parameters()):
        param.ds_id = index
    return module


def frozen(module: nn.Module) -> nn.Module:
    return module.requires_grad_(False)


class GuidedLoss(nn.Module):
    def __init__(self, model: nn.Module, guide: nn.Module):
        super().__init__()
        self.model, self.guide = model, guide


class Wrapper(nn.Module):
    def __init__(self, loss: nn.Module):
        super().__init__()
        self.loss = loss


def encoder() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU()))


def test_the_partitioned_frozen_guide_is_found_whole_inside_a_wrapper():
    model, guide = partitioned(nn.Linear(4, 4)), frozen(partitioned(encoder()))
    found = partitioned_frozen_encoders(Wrapper(GuidedLoss(model, guide)), model)
    assert [id(module) for module in found] == [id(guide)]


@pytest.mark.parametrize(
    "guide_of",
    [
        pytest.param(lambda model: frozen(encoder()), id="loaded-whole"),
        pytest.param(lambda model: partitioned(encoder()), id="trainable"),
        pytest.param(lambda model: model, id="the-model-itself"),
    ],
)
def test_nothing_else_is_found(guide_of):
    model = partitioned(nn.Linear(4, 4))
    assert partitioned_frozen_encoders(GuidedLoss(model, guide_of(model)), model) == []


def test_a_guide_shared_by_a_dict_of_losses_is_found_once():
    model, guide = nn.Linear(4, 4), frozen(partitioned(encoder()))
    losses = {"first": GuidedLoss(model, guide), "second": Wrapper(GuidedLoss(model, guide))}
    assert [id(module) for module in partitioned_frozen_encoders(losses, model)] == [id(guide)]


def test_the_engine_keeps_the_encoder_precision_and_the_numeric_zero_settings(monkeypatch):
    import transformers.integrations.deepspeed as hf_deepspeed

    zero = {"stage": 3, "stage3_prefetch_bucket_size": "auto", "offload_param": {"device": "cpu"}}
    training = {"zero_optimization": zero}
    monkeypatch.setattr(hf_deepspeed, "deepspeed_config", lambda: training)
    config = frozen_encoder_config(encoder().bfloat16())
    assert config["zero_optimization"] == {"stage": 3, "offload_param": {"device": "cpu"}}
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}
