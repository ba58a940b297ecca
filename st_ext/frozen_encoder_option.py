"""The trainer's ``frozen_encoders`` option: every guide and teacher of the loss kept, offloaded, or precomputed.

* ``"resident"`` (default): as upstream; frozen encoders stay on the training device.
* ``"offload"``: each stays on the CPU and visits the training device only for its no-grad pass.
* ``"precompute"``: each computes its outputs for every row of the training and evaluation
  datasets once, then is released (:func:`st_ext.offload.release`): nothing of it stays in memory.

Training gives the same results in every mode. The losses that take part are st_ext's
``GISTEmbedLoss``, ``CachedGISTEmbedLoss`` and ``DistillationLoss`` (also inside a
``MatryoshkaLoss``, a ``CrossBatchMemoryLoss`` or a dict of losses); they provide
``offload_frozen_encoder()`` and ``precompute_frozen_encoder(datasets, ...)``, which returns the
encoder it let go of; each encoder is released once, after every loss sharing it has precomputed.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from st_ext.offload import release

logger = logging.getLogger(__name__)

FROZEN_ENCODER_MODES = ("resident", "offload", "precompute")
_UPSTREAM_GUIDED = ("GISTEmbedLoss", "CachedGISTEmbedLoss")


def validate_frozen_encoder_mode(mode: str) -> str:
    if mode not in FROZEN_ENCODER_MODES:
        raise ValueError(f"frozen_encoders must be one of {', '.join(map(repr, FROZEN_ENCODER_MODES))}; got {mode!r}.")
    return mode


def _loss_modules(loss: Any) -> list[nn.Module]:
    losses = loss.values() if isinstance(loss, dict) else [loss]
    return [module for item in losses if isinstance(item, nn.Module) for module in item.modules()]


def frozen_encoder_losses(loss: Any) -> list[nn.Module]:
    """The loss modules (one loss, or a dict of them) whose frozen encoder st_ext can offload or precompute."""
    found = [module for module in _loss_modules(loss) if callable(getattr(module, "offload_frozen_encoder", None))]
    return list({id(module): module for module in found}.values())


def _refuse_upstream_guided_losses(loss: Any, mode: str) -> None:
    from st_ext._compat import st_losses

    upstream = st_losses()
    classes = tuple(getattr(upstream, name) for name in _UPSTREAM_GUIDED if hasattr(upstream, name))
    found = sorted({type(module).__name__ for module in _loss_modules(loss) if type(module) in classes})
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
    datasets: list[Any],
    device: Any,
    prompts: Any = None,
    show_progress_bar: bool = True,
) -> list[Any]:
    """Switch every frozen encoder of ``loss`` to ``mode``; return the release reports of ``"precompute"``."""
    validate_frozen_encoder_mode(mode)
    if mode == "resident":
        return []
    _refuse_upstream_guided_losses(loss, mode)
    holders = frozen_encoder_losses(loss)
    if not holders:
        raise ValueError(
            f"frozen_encoders={mode!r}, but the loss holds no frozen encoder st_ext can move (a guide of "
            "st_ext.losses.GISTEmbedLoss/CachedGISTEmbedLoss or a teacher of st_ext.losses.DistillationLoss). "
            "Leave frozen_encoders at 'resident' for this loss."
        )
    if mode == "offload":
        for holder in holders:
            holder.offload_frozen_encoder()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the trainer had moved the encoders onto the device; hand that back
        return []
    if prompts:
        raise ValueError(
            "frozen_encoders='precompute' looks rows up by their token ids, but the trainer adds prompts to the "
            "texts; use frozen_encoders='offload', or put the prompts into the dataset's texts."
        )
    if not datasets:
        raise ValueError("frozen_encoders='precompute' needs the training dataset when the trainer is built.")
    encoders = [
        holder.precompute_frozen_encoder(datasets, device=device, show_progress_bar=show_progress_bar)
        for holder in holders
    ]
    reports = []
    for encoder in {id(encoder): encoder for encoder in encoders if encoder is not None}.values():
        report = release(encoder, holders=holders)
        logger.info("%s", report)
        reports.append(report)
    return reports
