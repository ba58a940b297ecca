"""Gradient (activation) checkpointing over any module tree.

sentence-transformers models are containers: the layers that can be checkpointed live in Hugging
Face models somewhere inside (a ``Transformer`` module, the classifier of a ``CrossEncoder``, each
route of a ``Router``/``Asym``), or in custom modules that follow the same convention. These
functions find those *checkpointable* modules and switch them together:

1. :func:`checkpointable_modules` walks the tree and keeps the outermost module that can checkpoint
   on each branch: a Hugging Face model that declares ``supports_gradient_checkpointing``, or any
   other module with a ``gradient_checkpointing_enable`` method.
2. :func:`enable` / :func:`disable` call each of them with the arguments it accepts;
   ``use_reentrant=False`` is the default unless the caller says otherwise (the re-entrant variant
   breaks with DDP and with inputs that do not require grad).
3. :func:`is_enabled` reports whether any of them currently checkpoints.

A tree with nothing checkpointable is an error, never a silent no-op.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from st_ext import _compat

DEFAULT_CHECKPOINT_KWARGS = {"use_reentrant": False}


class CheckpointingNotSupportedError(ValueError):
    """The model holds no module that can checkpoint its activations."""


def checkpointable_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost checkpointable modules below ``root``, with their dotted names."""
    found: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            if id(child) in seen:
                continue
            seen.add(id(child))
            path = f"{prefix}.{name}" if prefix else name
            if _can_checkpoint(child):
                found.append((path, child))
            else:
                visit(path, child)

    visit("", root)
    return found


def _can_checkpoint(module: nn.Module) -> bool:
    if _compat.is_hf_model(module):
        # A wrapper that declines (e.g. some *ForRetrieval heads) may still hold a model that supports it.
        return bool(getattr(module, "supports_gradient_checkpointing", False))
    return callable(getattr(module, "gradient_checkpointing_enable", None))


def _require_checkpointable(root: nn.Module) -> list[tuple[str, nn.Module]]:
    targets = checkpointable_modules(root)
    if not targets:
        module_types = sorted({type(m).__name__ for m in root.modules() if m is not root}) or ["no submodules"]
        raise CheckpointingNotSupportedError(
            f"{type(root).__name__} has no module that supports gradient checkpointing "
            f"(it contains: {', '.join(module_types)}). Checkpointing needs a Hugging Face model "
            "with supports_gradient_checkpointing=True (e.g. a models.Transformer) or a custom module "
            "that defines gradient_checkpointing_enable(); train without gradient_checkpointing otherwise."
        )
    return targets


def enable(root: nn.Module, checkpoint_kwargs: dict | None = None, **extra: Any) -> list[str]:
    """Turn checkpointing on in every checkpointable module below ``root``; returns their names.

    ``checkpoint_kwargs`` go to ``torch.utils.checkpoint.checkpoint``; ``extra`` (such as
    transformers 5's ``every_n_layers``) is forwarded to the modules that accept it.
    """
    if checkpoint_kwargs is not None and not isinstance(checkpoint_kwargs, dict):
        raise TypeError(
            f"gradient_checkpointing_kwargs must be a dict such as {{'use_reentrant': False}}, "
            f"got {type(checkpoint_kwargs).__name__}."
        )
    kwargs = {**DEFAULT_CHECKPOINT_KWARGS, **(checkpoint_kwargs or {})}
    targets = _require_checkpointable(root)
    for _, module in targets:
        if _compat.is_hf_model(module):
            _compat.hf_checkpointing_enable(module, dict(kwargs), **extra)
        else:
            _enable_custom(module, kwargs, extra)
    return [name for name, _ in targets]


def _enable_custom(module: nn.Module, kwargs: dict, extra: dict) -> None:
    """Call a custom module's ``gradient_checkpointing_enable`` with whatever it accepts (maybe nothing)."""
    method = module.gradient_checkpointing_enable
    call_kwargs = _compat.accepted_kwargs(method, {**extra, "gradient_checkpointing_kwargs": dict(kwargs)})
    method(**call_kwargs)


def disable(root: nn.Module) -> list[str]:
    """Turn checkpointing off everywhere :func:`enable` turns it on; returns the module names."""
    targets = _require_checkpointable(root)
    for name, module in targets:
        if _compat.is_hf_model(module):
            _compat.hf_checkpointing_disable(module)
        elif callable(getattr(module, "gradient_checkpointing_disable", None)):
            module.gradient_checkpointing_disable()
        else:
            raise CheckpointingNotSupportedError(
                f"Module '{name}' ({type(module).__name__}) defines gradient_checkpointing_enable() but no "
                "gradient_checkpointing_disable(), so checkpointing cannot be switched off there. "
                "Add gradient_checkpointing_disable() to that module."
            )
    return [name for name, _ in targets]


def is_enabled(root: nn.Module) -> bool:
    """Whether any checkpointable module below ``root`` currently checkpoints."""
    return any(_module_checkpoints(module) for _, module in checkpointable_modules(root))


def _module_checkpoints(module: nn.Module) -> bool:
    if not _compat.is_hf_model(module):
        declared = getattr(module, "is_gradient_checkpointing", None)
        if isinstance(declared, bool):
            return declared
    # The transformers convention, in every version: layers carry a boolean `gradient_checkpointing`.
    return any(getattr(sub, "gradient_checkpointing", False) is True for sub in module.modules())
