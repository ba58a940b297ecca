"""``st-ext train``'s LoRA settings: checked before anything loads, then the adapter put on the loaded model.

With ``--lora-rank`` set, the model trains a LoRA adapter (peft) instead of all its weights, as decoder
embedders (Qwen3-Embedding, gte-Qwen2, e5-mistral) are usually fine-tuned; the saved model is the adapter
(``adapter_config.json`` and its weights), which sentence-transformers loads over the base model.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from torch import nn

from st_ext.cli.errors import ConfigError

PEFT_MISSING = "LoRA needs the peft package: pip install 'st-ext[peft]' (or pip install peft), or leave out lora_rank."


def check_lora_settings(config: Any) -> None:
    """Refuse LoRA settings that cannot work, each in one line, before any model loads."""
    given = [name for name in ("lora_alpha", "lora_dropout", "lora_target_modules") if getattr(config, name)]
    if config.lora_rank is None:
        if given:
            raise ConfigError(f"{given[0]}: only a LoRA adapter uses it; set lora_rank too, or leave it out.")
        return
    if not (isinstance(config.lora_rank, int) and config.lora_rank > 0):
        raise ConfigError(f"lora_rank: {config.lora_rank!r} must be a positive integer (8 or 16 are usual).")
    if config.lora_alpha is not None and not config.lora_alpha > 0:
        raise ConfigError(f"lora_alpha: {config.lora_alpha} must be a number above 0 (unset: twice lora_rank).")
    if config.lora_dropout is not None and not 0 <= config.lora_dropout < 1:
        raise ConfigError(f"lora_dropout: {config.lora_dropout} must be at least 0 and below 1.")
    if config.lora_target_modules is not None and not all(name.strip() for name in config.lora_target_modules):
        raise ConfigError("lora_target_modules: an empty name; give module names such as q_proj v_proj.")
    if importlib.util.find_spec("peft") is None:
        raise ConfigError(f"lora_rank: {PEFT_MISSING}")


def lora_config(config: Any) -> Any:
    """The peft ``LoraConfig`` of the settings; target modules unset: peft's default for the architecture."""
    from peft import LoraConfig

    return LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha if config.lora_alpha is not None else 2 * config.lora_rank,
        lora_dropout=config.lora_dropout or 0.0,
        target_modules=config.lora_target_modules or None,
    )


def add_lora(model: nn.Module, config: Any) -> str | None:
    """Put the configured adapter on ``model`` (nothing without lora_rank); returns a line saying what trains."""
    if config.lora_rank is None:
        return None
    from st_ext.adapters import add_lora_adapter

    try:
        add_lora_adapter(model, lora_config(config))
    except ValueError as error:
        if config.lora_target_modules is None:
            raise ConfigError(
                f"lora_target_modules: peft has no default for this model ({str(error).splitlines()[0]}); "
                "name its linear layers, e.g. --lora-target-modules q_proj v_proj."
            ) from None
        linear = sorted(
            {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)}
        )
        raise ConfigError(
            f"lora_target_modules: {' '.join(config.lora_target_modules)} names no layer of the model; "
            f"its linear layers are {' '.join(linear)}."
        ) from None
    trainable = sum(param.numel() for param in model.parameters() if param.requires_grad)
    total = sum(param.numel() for param in model.parameters())
    return f"LoRA adapter of rank {config.lora_rank}: {trainable:,} of {total:,} weights train"
