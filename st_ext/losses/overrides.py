"""Subclasses that override the steps of upstream's cached engine, which st_ext's engine never calls.

st_ext's engine plans its own mini-batches and merges columns into shared forward passes, so it calls
none of upstream's per-mini-batch hooks: without a check, a user's override (a projection, logging)
would silently do nothing. Such a loss runs upstream's own forward instead, which calls it.
"""

from __future__ import annotations

import inspect
import warnings
import weakref

from torch import nn

from st_ext.losses.auto_mini_batch import AUTO

#: Each counts only where the installed release's class has it (4.x also has calculate_loss_and_cache_gradients).
UPSTREAM_ENGINE_HOOKS = ("embed_minibatch", "embed_minibatch_iter", "calculate_loss_and_cache_gradients")

#: The warning is once per class, not once per step.
_warned: weakref.WeakSet[type] = weakref.WeakSet()


def upstream_hook_overrides(loss: nn.Module, upstream_class: type) -> tuple[str, ...]:
    """The hooks of ``upstream_class``'s engine that ``type(loss)`` replaces; empty: st_ext's engine may run ``loss``.

    When one is replaced, ``loss`` must run ``upstream_class.forward``: this raises ValueError where that
    cannot work (``loss`` is st_ext's own implementation under upstream's name, or uses
    ``mini_batch_size="auto"``, which upstream's forward cannot resolve), and otherwise warns, once per
    class, that st_ext's engine is bypassed. st_ext's classes call it once, at construction; a wrapper
    asks it of upstream's instances when it describes them.
    """
    loss_class = type(loss)
    overridden = tuple(
        name
        for name in UPSTREAM_ENGINE_HOOKS
        if hasattr(upstream_class, name)
        and inspect.getattr_static(loss_class, name, None) not in (None, inspect.getattr_static(upstream_class, name))
    )
    if not overridden:
        return ()
    what = f"{loss_class.__qualname__} overrides {', '.join(overridden)} of upstream's {upstream_class.__name__}"
    keep_engine = "or move the customisation into the model (e.g. a module after pooling) and drop the override"
    if not isinstance(loss, upstream_class):
        raise ValueError(
            f"{what}, but st_ext's {upstream_class.__name__} is st_ext's own implementation and never calls "
            f"{'/'.join(overridden)}. Subclass sentence_transformers' {upstream_class.__name__} instead (upstream's "
            f"engine calls the override, without st_ext's options), {keep_engine}."
        )
    if getattr(loss, "mini_batch_size", None) == AUTO:
        raise ValueError(
            f"{what}, which only upstream's forward calls, and upstream's forward cannot choose the mini-batch "
            f"size: give mini_batch_size a number (e.g. mini_batch_size=32, without memory_budget_mb), {keep_engine}."
        )
    if loss_class not in _warned:
        _warned.add(loss_class)
        warnings.warn(
            f"{what}: st_ext runs upstream's forward for it, which calls the override, so st_ext's faster engine "
            f"(merged passes, auto mini-batch size) is bypassed for {loss_class.__qualname__}. To keep st_ext's "
            f"engine, move the customisation into the model and drop the override.",
            UserWarning,
            stacklevel=4,
        )
    return overridden
