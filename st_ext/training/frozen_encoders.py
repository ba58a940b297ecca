"""``SentenceTransformerTrainer(frozen_encoders=...)``: guides and teachers resident, offloaded or precomputed.

* ``"resident"`` (default): as upstream; frozen encoders stay on the training device.
* ``"offload"``: each stays on the CPU and visits the training device only for its no-grad pass.
* ``"precompute"``: each loss holding one computes its outputs for every row of the datasets it
  will see (with a dict of losses, those of its keys), then the encoder is released, once, after
  every loss sharing it has precomputed.

Training gives the same results in every mode. The losses that take part are st_ext's
:class:`~st_ext.losses.frozen_encoders.FrozenEncoderHolder` ones, wherever they sit in the loss.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from st_ext._compat import upstream_loss_class
from st_ext.losses.frozen_encoders import FrozenEncoderHolder
from st_ext.offload import release

logger = logging.getLogger(__name__)

FROZEN_ENCODER_MODES = ("resident", "offload", "precompute")
_UPSTREAM_GUIDED = ("GISTEmbedLoss", "CachedGISTEmbedLoss")


def validate_frozen_encoder_mode(mode: str) -> str:
    if mode not in FROZEN_ENCODER_MODES:
        raise ValueError(f"frozen_encoders must be one of {', '.join(map(repr, FROZEN_ENCODER_MODES))}; got {mode!r}.")
    return mode


def require_resident(mode: str, trainer_name: str) -> str:
    """Accept only ``"resident"``: for the sparse and multi-vector trainers, whose losses hold no frozen
    encoder (their distillation losses read the teacher's scores from a label column), so that any other
    mode would silently do nothing."""
    validate_frozen_encoder_mode(mode)
    if mode != "resident":
        raise ValueError(
            f"{trainer_name} accepts only frozen_encoders='resident'; got {mode!r}. The option covers "
            "SentenceTransformerTrainer's GIST guides and distillation teachers only: sentence-transformers' "
            "sparse and multi-vector distillation losses take the teacher's scores as labels, with no teacher "
            "model in the loss. Compute the labels with the teacher before training, then free it with "
            "st_ext.offload.release(teacher)."
        )
    return mode


def each_loss(loss: Any) -> list[Any]:
    """A trainer's losses: its one loss, or each loss of its dict (one per dataset)."""
    return [item for _, item in named_losses(loss)]


def named_losses(loss: Any) -> list[tuple[str, Any]]:
    """``(dataset name, loss)`` for each loss of a trainer's dict, or ``("", loss)`` for its one loss."""
    return list(loss.items()) if isinstance(loss, dict) else [("", loss)]


def loss_modules(loss: Any) -> list[nn.Module]:
    """Every module of a trainer's loss (one loss, or a dict of them), wrapped losses included."""
    return [module for item in each_loss(loss) if isinstance(item, nn.Module) for module in item.modules()]


def frozen_encoder_losses(loss: Any) -> list[FrozenEncoderHolder]:
    """The loss modules (one loss, or a dict of them) whose frozen encoder st_ext can offload or precompute."""
    found = [module for module in loss_modules(loss) if isinstance(module, FrozenEncoderHolder)]
    return list({id(module): module for module in found}.values())


def holders_and_their_datasets(
    loss: Any, train_dataset: Any, eval_dataset: Any
) -> list[tuple[FrozenEncoderHolder, list]]:
    """Each loss holding a frozen encoder, with the datasets it will see: all of them, or with a dict of
    losses those of its key (a dict of datasets routes ``datasets[key]`` to ``loss[key]``)."""
    routed: dict[int, tuple[FrozenEncoderHolder, list]] = {}
    for key, item in named_losses(loss):
        given: tuple[Any, ...] = (train_dataset, eval_dataset)
        if isinstance(loss, dict):
            given = tuple(datasets.get(key) if isinstance(datasets, dict) else datasets for datasets in given)
        for holder in frozen_encoder_losses(item):
            routed.setdefault(id(holder), (holder, []))[1].extend(dataset for dataset in given if dataset is not None)
    return list(routed.values())


def _refuse_upstream_guided_losses(loss: Any, mode: str) -> None:
    classes = tuple(filter(None, map(upstream_loss_class, _UPSTREAM_GUIDED)))
    found = sorted(
        {
            type(module).__name__
            for module in loss_modules(loss)
            if isinstance(module, classes) and not isinstance(module, FrozenEncoderHolder)
        }
    )
    if found:
        raise TypeError(
            f"frozen_encoders={mode!r} cannot move the guide of sentence-transformers' {', '.join(found)}: it is a "
            "submodule the trainer keeps on the training device. Use st_ext's class of the same name "
            "(`from st_ext.losses import GISTEmbedLoss, CachedGISTEmbedLoss`; same arguments)."
        )


def apply_frozen_encoder_mode(
    mode: str,
    loss: Any,
    *,
    train_dataset: Any = None,
    eval_dataset: Any = None,
    device: Any = None,
    prompts: Any = None,
    show_progress_bar: bool = True,
) -> list[Any]:
    """Switch every frozen encoder of ``loss`` to ``mode``; return the release reports of ``"precompute"``.

    ``train_dataset``/``eval_dataset`` as given to the trainer (a dataset or a dict of them per loss);
    ``device``: where ``"precompute"`` runs the encoders (default: where each is).
    """
    validate_frozen_encoder_mode(mode)
    if mode == "resident":
        return []
    _refuse_upstream_guided_losses(loss, mode)
    holders = holders_and_their_datasets(loss, train_dataset, eval_dataset)
    if not holders:
        raise ValueError(
            f"frozen_encoders={mode!r}, but the loss holds no frozen encoder st_ext can move (a guide of "
            "st_ext.losses.GISTEmbedLoss/CachedGISTEmbedLoss or a teacher of st_ext.losses.DistillationLoss). "
            "Leave frozen_encoders at 'resident' for this loss."
        )
    if mode == "offload":
        for holder, _ in holders:
            holder.offload_frozen_encoder()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return []
    if prompts:
        raise ValueError(
            "frozen_encoders='precompute' looks rows up by their token ids, but the trainer adds prompts to the "
            "texts; use frozen_encoders='offload', or put the prompts into the dataset's texts."
        )
    without_data = [type(holder).__name__ for holder, datasets in holders if not datasets]
    if without_data:
        raise ValueError(
            f"frozen_encoders='precompute' needs the datasets {', '.join(without_data)} will see when the trainer "
            "is built (train_dataset, and eval_dataset if any)."
        )
    encoders = [
        holder.precompute_frozen_encoder(datasets, device=device, show_progress_bar=show_progress_bar)
        for holder, datasets in holders
    ]
    reports = []
    for encoder in {id(encoder): encoder for encoder in encoders if encoder is not None}.values():
        report = release(encoder, holders=[holder for holder, _ in holders])
        logger.info("%s", report)
        reports.append(report)
    return reports
