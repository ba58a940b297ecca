"""The launch configurations in ``examples/`` that the sharded-training recipes in docs/distributed.md name: each loads
with the tool that reads it, and asks for what the README says it does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ROOT = EXAMPLES.parent


def accelerate_config(name: str):
    from accelerate.commands.config.config_args import load_config_from_file

    return load_config_from_file(str(EXAMPLES / name))


@pytest.mark.parametrize("name, stage", [("deepspeed_zero2.json", 2), ("deepspeed_zero3.json", 3)])
def test_deepspeed_configs_leave_sizes_to_the_trainer(name, stage):
    config = json.loads((EXAMPLES / name).read_text())
    assert config["zero_optimization"]["stage"] == stage
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
        assert config[key] == "auto", key
    if stage == 3:
        assert config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


def test_accelerate_deepspeed_config_points_at_the_zero3_json():
    config = accelerate_config("accelerate_deepspeed_zero3.yaml")
    assert str(config.distributed_type) == "DistributedType.DEEPSPEED"
    assert (ROOT / config.deepspeed_config["deepspeed_config_file"]).is_file()


def test_accelerate_fsdp_config_asks_for_fsdp2_and_a_full_state_dict():
    config = accelerate_config("accelerate_fsdp2.yaml")
    assert str(config.distributed_type) == "DistributedType.FSDP"
    assert int(config.fsdp_config["fsdp_version"]) == 2
    assert config.fsdp_config["fsdp_state_dict_type"] == "FULL_STATE_DICT"
