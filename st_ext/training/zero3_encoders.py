"""Frozen encoders that DeepSpeed ZeRO-3 partitioned while loading them, made to gather their weights on use.

While a ZeRO-3 configuration is alive (training arguments with ``deepspeed=``, or accelerate's
``zero3_init_flag``), transformers loads every model under ``deepspeed.zero.Init``: each rank keeps
a slice of every weight. A GIST guide or a distillation teacher loaded then is partitioned but given
to no engine, so its first forward pass fails ("'weight' must be 2-D"). Each such encoder gets an
engine of its own here, with ZeRO-3 and no optimizer: its weights stay partitioned and each layer is
gathered for its pass, as for the trained model. This needs every rank to run the encoder's passes
together, which the cached and GIST losses do (the same number of times on every rank).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from st_ext._compat import live_deepspeed_config
from st_ext.gradient_sync import zero3_partitioned
from st_ext.offload.releasing import DEEPSPEED_ENGINE_ATTRIBUTE
from st_ext.training.frozen_encoders import each_loss


def partitioned_frozen_encoders(loss: Any, model: nn.Module | None) -> list[nn.Module]:
    """The largest frozen modules of ``loss`` (one loss, or a dict of them) that ZeRO-3 partitioned and
    that share no parameter with ``model``, the one the trainer's engine will gather."""
    trained = {id(param) for param in model.parameters()} if model is not None else set()
    found: dict[int, nn.Module] = {}
    for item in each_loss(loss):
        if isinstance(item, nn.Module):
            for encoder in _outside_model(item, trained):
                found[id(encoder)] = encoder
    return list(found.values())


def _outside_model(module: nn.Module, trained: set[int]):
    """The frozen, partitioned descendants of ``module`` outside the trained parameters, largest first."""
    for child in module.children():
        params = list(child.parameters())
        if all(id(param) in trained for param in params):
            continue
        if (
            zero3_partitioned(child)
            and not any(param.requires_grad for param in params)
            and trained.isdisjoint(id(param) for param in params)
        ):
            yield child
        else:
            yield from _outside_model(child, trained)


def serve_partitioned_encoders(loss: Any, model: nn.Module | None) -> list[nn.Module]:
    """Give every frozen encoder of ``loss`` that ZeRO-3 partitioned an engine that gathers its weights
    for each forward pass; return the encoders that got one now."""
    served = []
    for encoder in partitioned_frozen_encoders(loss, model):
        if hasattr(encoder, DEEPSPEED_ENGINE_ATTRIBUTE):  # served for an earlier trainer over the same loss
            continue
        import deepspeed  # the encoder's partitioned weights mean that DeepSpeed is installed and in use

        engine, *_ = deepspeed.initialize(model=encoder, config=frozen_encoder_config(encoder))
        # Kept as long as the encoder (deleting the engine removes its hooks); not a submodule, so outside
        # state_dict and .to(); st_ext.offload.release destroys it.
        object.__setattr__(encoder, DEEPSPEED_ENGINE_ATTRIBUTE, engine)
        served.append(encoder)
    return served


def frozen_encoder_config(encoder: nn.Module) -> dict:
    """The engine configuration for a frozen ``encoder``: ZeRO-3 as the training configuration sets it
    (its settings that are numbers or flags rather than ``"auto"``), no optimizer, and the precision the
    encoder was loaded in, so that its weights stay as they are."""
    training_zero = (live_deepspeed_config() or {}).get("zero_optimization", {})
    zero = {key: value for key, value in training_zero.items() if value != "auto"}
    zero["stage"] = 3
    dtype = next(encoder.parameters()).dtype
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
    }
