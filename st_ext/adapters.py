"""LoRA adapters on the Hugging Face model inside a sentence-transformers model.

Upstream documents ``model.add_adapter(LoraConfig(...))``, which hands the config to transformers' own
``add_adapter``. transformers 5.24 refuses any peft below 0.22 there, while the newest peft on the package
index may be older: peft's own ``get_peft_model`` on the Hugging Face model works with every peft, and the
``PeftModel`` it returns saves and reloads as upstream expects (``adapter_config.json`` and
``adapter_model.safetensors`` in the Transformer module's folder). :func:`add_lora_adapter` takes
upstream's way where the installed versions accept it and peft's otherwise; st_ext's losses, checkpointing
and trainers work the same on both.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

from packaging.version import Version
from torch import nn

from st_ext import _compat

PEFT_MISSING = "LoRA adapters need the peft package: pip install 'st-ext[peft]' (or pip install peft)."


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ImportError(PEFT_MISSING) from None
    return peft


def transformers_accepts_peft() -> bool:
    """Whether the installed transformers' ``add_adapter`` accepts the installed peft."""
    _peft()
    from transformers.integrations import peft as transformers_peft

    minimum = getattr(transformers_peft, "MIN_PEFT_VERSION", "0")
    return Version(importlib.metadata.version("peft")) >= Version(minimum)


def _hf_model_slot(model: nn.Module) -> tuple[nn.Module, str, nn.Module]:
    """The first Hugging Face model (or PEFT wrapper of one) below ``model``: its parent, attribute name and
    itself, the one upstream's ``add_adapter`` adapts."""
    for parent in model.modules():
        for name, child in parent.named_children():
            if _compat.is_hf_model(child) or callable(getattr(child, "get_base_model", None)):
                return parent, name, child
    raise ValueError(
        f"{type(model).__name__} holds no Hugging Face model to put an adapter on; adapters need a model "
        "with a Transformer module."
    )


def add_lora_adapter(model: nn.Module, config: Any) -> nn.Module:
    """Attach a new adapter of ``config`` (a peft ``LoraConfig``) to ``model``'s Hugging Face model, freezing
    everything else; returns the module that now runs it (the Hugging Face model, or its ``PeftModel``)."""
    peft = _peft()
    parent, name, hf_model = _hf_model_slot(model)
    if callable(getattr(hf_model, "get_base_model", None)):
        raise ValueError(
            f"{type(model).__name__} already runs a peft adapter; add another with its add_adapter(name, config)."
        )
    if transformers_accepts_peft() and _compat.is_hf_model(hf_model):
        hf_model.add_adapter(config)
        return hf_model
    adapted = peft.get_peft_model(hf_model, config)
    setattr(parent, name, adapted)
    return adapted


def load_lora_adapter(model: nn.Module, adapter_path: str | Path, *, trainable: bool = True) -> nn.Module:
    """Put the adapter saved in ``adapter_path`` (an ``adapter_config.json`` and its weights, as
    ``model.save`` or peft writes them) on ``model``'s Hugging Face model, trainable unless ``trainable=False``;
    returns the ``PeftModel`` that now runs it. Works whatever peft the installed transformers accepts."""
    peft = _peft()
    parent, name, hf_model = _hf_model_slot(model)
    if not (Path(adapter_path) / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"{adapter_path} holds no adapter_config.json; pass the folder model.save() or peft's save_pretrained wrote."
        )
    adapted = peft.PeftModel.from_pretrained(hf_model, str(adapter_path), is_trainable=trainable)
    setattr(parent, name, adapted)
    return adapted
