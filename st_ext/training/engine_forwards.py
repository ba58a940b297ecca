"""The trainers' ``compute_loss`` for sentence-transformers' own cached losses: st_ext's engine forwards them.

Upstream's ``compute_loss`` calls the loss's own forward, whose GradCache reduces after every mini-batch
under FSDP2 and ZeRO and returns a loss DeepSpeed refuses. For a loss that
:func:`~st_ext.losses.upstream_forwards.engine_forward` can run, the trainer calls that forward instead,
with what upstream's ``compute_loss`` hands the loss's (the columns, the labels, and for a CrossEncoder the
prompt and task); everything around the call is as upstream's: the wrapped model swapped into the loss
once, a loss returned as named terms logged term by term and summed.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from st_ext import losses as st_ext_losses
from st_ext._compat import st_losses
from st_ext.losses.upstream_forwards import EngineForward, engine_forward, refusal
from st_ext.training.frozen_encoders import each_loss

#: Upstream loss classes already named in a warning: each is named once per process.
_warned: set[str] = set()


def engine_forwards(loss: Any) -> dict[int, EngineForward]:
    """Each of the trainer's losses (one, or a dict of them) that st_ext's engine forwards, by ``id``; a loss
    that cannot run on it with its settings is refused here, when the trainer is built."""
    forwards = {}
    for item in each_loss(loss):
        reason = refusal(item)
        if reason is not None:
            raise ValueError(reason)
        forward = engine_forward(item)
        if forward is not None:
            forwards[id(item)] = forward
    return forwards


def selected_loss(loss: Any, inputs: dict[str, Any]) -> Any:
    """The loss upstream's ``compute_loss`` picks for ``inputs``: the dict's entry for their dataset, or the loss."""
    dataset_name = inputs.get("dataset_name")
    return loss[dataset_name] if isinstance(loss, dict) and dataset_name else loss


def compute_loss_on_engine(
    trainer: Any, forward: EngineForward, model: Any, inputs: dict[str, Any], return_outputs: bool
):
    """Upstream's ``compute_loss`` with ``forward`` in place of the loss's own forward."""
    inputs.pop("dataset_name", None)
    keywords = {name: inputs.pop(name, None) for name in forward.trainer_keywords}
    features, labels = trainer.collect_features(inputs)
    loss_fn = forward.loss
    if model == trainer.model_wrapped and loss_fn.model != model:
        trainer.override_model_in_loss(loss_fn, model)
    loss = forward.forward(features, labels, **keywords)
    if isinstance(loss, dict):
        trainer.track_loss_components(loss)
        loss = torch.stack(list(loss.values())).sum()
    return (loss, {}) if return_outputs else loss


def replaced_pairs() -> list[tuple[type, type]]:
    """``(upstream class, st_ext class)`` for every loss of the installed release that st_ext replaces."""
    upstream = st_losses()
    pairs = []
    for name in st_ext_losses.ST_EXT_LOSSES:
        theirs, ours = getattr(upstream, name, None), getattr(st_ext_losses, name)
        if isinstance(theirs, type) and isinstance(ours, type) and theirs is not ours:
            pairs.append((theirs, ours))
    return pairs


def upstream_replaced_losses(loss: Any, forwards: dict[int, EngineForward]) -> list[str]:
    """The names of upstream's classes that st_ext replaces found in the trainer's loss (wrapped ones included),
    where st_ext's engine does not run them: a loss ``forwards`` holds is run by the engine as st_ext's class
    is, and what st_ext's own classes wrap is theirs to run."""
    pairs = replaced_pairs()
    ours = tuple(st_ext_class for _, st_ext_class in pairs)
    found: list[str] = []
    stack = [item for item in each_loss(loss) if isinstance(item, nn.Module) and id(item) not in forwards]
    while stack:
        module = stack.pop()
        if isinstance(module, ours):
            continue
        for upstream_class, _ in pairs:
            if isinstance(module, upstream_class) and upstream_class.__name__ not in found:
                found.append(upstream_class.__name__)
        stack.extend(module.children())
    return found


def warn_upstream_replaced_losses(trainer_name: str, loss: Any, forwards: dict[int, EngineForward]) -> None:
    """Warn, once per class and process, that upstream's classes st_ext replaces run as upstream wrote them, and
    name the import line that gives st_ext's instead."""
    names = [name for name in upstream_replaced_losses(loss, forwards) if name not in _warned]
    if not names:
        return
    _warned.update(names)
    listed = ", ".join(names)
    warnings.warn(
        f"{trainer_name} got sentence-transformers' own {listed}, which st_ext's trainer runs as sentence-transformers "
        f"wrote {'them' if len(names) > 1 else 'it'}, without st_ext's memory fixes. Import st_ext's: change "
        f"`from {st_losses().__name__} import {listed}` (or `from sentence_transformers import losses`) to "
        f"`from st_ext.losses import {listed}` (or `from st_ext import losses`); `st-ext swap-imports SCRIPT` "
        "rewrites a script's imports.",
        UserWarning,
        stacklevel=4,
    )
