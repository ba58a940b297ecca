"""The trainers' ``compute_loss`` for sentence-transformers' own cached losses: st_ext's engine forwards them.

Upstream's ``compute_loss`` calls the loss's own forward, whose GradCache reduces after every mini-batch
under FSDP2 and ZeRO and returns a loss DeepSpeed refuses. For a loss that
:func:`~st_ext.losses.upstream_forwards.engine_forward` can run, the trainer calls that forward instead,
with what upstream's ``compute_loss`` hands the loss's (the columns, the labels, and for a CrossEncoder the
prompt and task); everything around the call is as upstream's: the wrapped model swapped into the loss
once, a loss returned as named terms logged term by term and summed.
"""

from __future__ import annotations

from typing import Any

import torch

from st_ext.losses.upstream_forwards import EngineForward, engine_forward, refusal
from st_ext.training.frozen_encoders import each_loss


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
