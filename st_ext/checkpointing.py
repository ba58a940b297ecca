"""Gradient (activation) checkpointing over any module tree.

sentence-transformers models are containers: the layers that can be checkpointed live in Hugging
Face models somewhere inside (a ``Transformer`` module, the classifier of a ``CrossEncoder``, each
route of a ``Router``/``Asym``), or in custom modules that follow the same convention. These
functions switch all of them together, each by the name its transformers version prefers.
sentence-transformers models met on the way are walked through rather than called: their own
methods reach only part of the tree in some releases, and use transformers' deprecated names in others.

A tree with nothing to checkpoint (say a ``StaticEmbedding`` alone) is not an error: upstream skips
it there, so :func:`enable` logs a warning naming what the tree holds.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from st_ext import _compat

logger = logging.getLogger(__name__)

#: The re-entrant variant breaks with DDP and with inputs that do not require grad.
DEFAULT_CHECKPOINT_KWARGS = {"use_reentrant": False}


class CheckpointingNotSupportedError(ValueError):
    """A checkpointing request that cannot be honoured (a module that can be switched on but never off)."""


#: The hooks :func:`enable` put on frozen input embeddings for re-entrant checkpointing, removed by :func:`disable`.
_INPUT_GRAD_HOOKS: weakref.WeakKeyDictionary[nn.Module, RemovableHandle] = weakref.WeakKeyDictionary()


def survey(root: nn.Module) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]]]:
    """The outermost checkpointable modules below ``root``, and the modules that declare
    ``supports_gradient_checkpointing = False`` (with nothing checkpointable inside), by dotted name.

    Checkpointable: a Hugging Face model that declares ``supports_gradient_checkpointing``, or any other
    module with an ``activation_checkpointing_enable``/``gradient_checkpointing_enable`` method.
    """
    targets: list[tuple[str, nn.Module]] = []
    declined: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    containers = _compat.upstream_model_classes()

    def visit(prefix: str, module: nn.Module) -> int:
        found_before = len(targets)
        for name, child in module.named_children():
            if id(child) in seen:
                continue
            seen.add(id(child))
            path = f"{prefix}.{name}" if prefix else name
            if not isinstance(child, containers) and _can_checkpoint(child):
                targets.append((path, child))
            elif visit(path, child) == 0 and _declines(child):
                declined.append((path, child))
        return len(targets) - found_before

    visit("", root)
    return targets, declined


def checkpointable_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost checkpointable modules below ``root``, with their dotted names."""
    return survey(root)[0]


def _has_switch(module: nn.Module) -> bool:
    return callable(getattr(module, "activation_checkpointing_enable", None)) or callable(
        getattr(module, "gradient_checkpointing_enable", None)
    )


def _declines(module: nn.Module) -> bool:
    return _has_switch(module) and getattr(module, "supports_gradient_checkpointing", True) is False


def _can_checkpoint(module: nn.Module) -> bool:
    if _compat.is_hf_model(module):
        # A wrapper that declines (e.g. some *ForRetrieval heads) may still hold a model that supports it.
        return bool(getattr(module, "supports_gradient_checkpointing", False))
    return _has_switch(module) and not _declines(module)


def enable(root: nn.Module, checkpoint_kwargs: dict | None = None, **extra: Any) -> list[str]:
    """Turn checkpointing on in every checkpointable module below ``root``; returns their names.

    ``checkpoint_kwargs`` go to ``torch.utils.checkpoint.checkpoint``; ``extra`` (such as
    transformers 5's ``every_n_layers``) is forwarded to the modules that accept it. Modules that
    cannot checkpoint are skipped with a logged warning, never an error.
    """
    if checkpoint_kwargs is not None and not isinstance(checkpoint_kwargs, dict):
        raise TypeError(
            f"gradient_checkpointing_kwargs must be a dict such as {{'use_reentrant': False}}, "
            f"got {type(checkpoint_kwargs).__name__}."
        )
    kwargs = {**DEFAULT_CHECKPOINT_KWARGS, **(checkpoint_kwargs or {})}
    targets, declined = survey(root)
    # Upstream skips these too (6.x with a warning, 4.x silently).
    if declined:
        logger.warning(
            "Gradient checkpointing skips %s: they declare supports_gradient_checkpointing=False.",
            ", ".join(f"'{name}' ({type(module).__name__})" for name, module in declined),
        )
    if not targets:
        contents = sorted({type(m).__name__ for m in root.modules() if m is not root}) or ["no submodules"]
        logger.warning(
            "%s has no module that can checkpoint its activations (it contains: %s); it runs without gradient "
            "checkpointing. Checkpointing needs a Hugging Face model with supports_gradient_checkpointing=True "
            "(e.g. inside a Transformer module) or a custom module defining gradient_checkpointing_enable().",
            type(root).__name__,
            ", ".join(contents),
        )
    for _, module in targets:
        if kwargs.get("use_reentrant", True):
            _let_gradients_reach_checkpointed_layers(module)
        if _compat.is_hf_model(module):
            _compat.hf_checkpointing_enable(module, dict(kwargs), **extra)
            continue
        # A custom switch gets whatever it accepts (maybe nothing), by transformers 5's name where it has it.
        method = getattr(module, "activation_checkpointing_enable", None)
        keyword = "activation_checkpointing_kwargs"
        if not callable(method):
            method, keyword = getattr(module, "gradient_checkpointing_enable"), "gradient_checkpointing_kwargs"
        method(**_compat.accepted_kwargs(method, {**extra, keyword: dict(kwargs)}))
    return [name for name, _ in targets]


def disable(root: nn.Module) -> list[str]:
    """Turn checkpointing off everywhere :func:`enable` turns it on; returns the module names.

    A custom module that can be switched on but has no way to be switched off raises
    :class:`CheckpointingNotSupportedError`: it would go on checkpointing.
    """
    targets = checkpointable_modules(root)
    for name, module in targets:
        embeddings = _input_embeddings(module)
        if embeddings is not None and embeddings in _INPUT_GRAD_HOOKS:
            _INPUT_GRAD_HOOKS.pop(embeddings).remove()
        if _compat.is_hf_model(module):
            _compat.hf_checkpointing_disable(module)
            continue
        method = getattr(module, "activation_checkpointing_disable", None)
        if not callable(method):
            method = getattr(module, "gradient_checkpointing_disable", None)
        if not callable(method):
            raise CheckpointingNotSupportedError(
                f"Module '{name}' ({type(module).__name__}) defines gradient_checkpointing_enable() but no "
                "gradient_checkpointing_disable(), so checkpointing cannot be switched off there. "
                "Add gradient_checkpointing_disable() to that module."
            )
        method()
    return [name for name, _ in targets]


def _input_embeddings(module: nn.Module) -> nn.Module | None:
    """The module's input embeddings (a PEFT wrapper answers for the model it wraps), or None."""
    get_embeddings = getattr(module, "get_input_embeddings", None)
    try:
        embeddings = get_embeddings() if callable(get_embeddings) else None
    except NotImplementedError:
        return None
    return embeddings if isinstance(embeddings, nn.Module) else None


def _let_gradients_reach_checkpointed_layers(module: nn.Module) -> None:
    """Re-entrant checkpointing computes a segment's parameter gradients only when one of the segment's inputs
    requires grad. With the input embeddings frozen and weights inside the layers trainable (a LoRA adapter),
    nothing does, and those weights would silently get no gradient: the embeddings' output is made to require
    grad, as transformers does for the adapters its own ``add_adapter`` attaches (only there in transformers 4)."""
    embeddings = _input_embeddings(module)
    if embeddings is None or embeddings in _INPUT_GRAD_HOOKS:
        return
    if any(param.requires_grad for param in embeddings.parameters()):
        return
    if any(param.requires_grad for param in module.parameters()):
        _INPUT_GRAD_HOOKS[embeddings] = embeddings.register_forward_hook(_output_requires_grad)


def _output_requires_grad(module: nn.Module, inputs: Any, output: Any) -> None:
    output.requires_grad_(True)


@contextlib.contextmanager
def switched_on(root: nn.Module) -> Iterator[None]:
    """Checkpointing on inside the block, and back off after it unless it was on already (for a caller
    that checkpoints some passes only, such as ``mini_batch_size="auto"``)."""
    if is_enabled(root):
        yield
        return
    enable(root)
    try:
        yield
    finally:
        disable(root)


def is_enabled(root: nn.Module) -> bool:
    """Whether any checkpointable module below ``root`` currently checkpoints."""
    return any(_module_checkpoints(module) for _, module in checkpointable_modules(root))


def _module_checkpoints(module: nn.Module) -> bool:
    if _compat.is_hf_model(module):
        return _compat.hf_is_checkpointing(module)
    for flag_name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        declared = getattr(module, flag_name, None)
        if isinstance(declared, bool):
            return declared
    # The transformers convention, in every version: layers carry a boolean `gradient_checkpointing`.
    return any(getattr(sub, "gradient_checkpointing", False) is True for sub in module.modules())
