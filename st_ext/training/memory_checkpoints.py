"""Saving and restoring the queues of every cross-batch memory in a trainer's loss with its checkpoints.

A run resumed without its queues would train on with empty ones and diverge from the uninterrupted run, so
st_ext's trainer writes them inside each checkpoint and refuses to resume from one that lacks them; with an
upstream trainer, :class:`CrossBatchMemoryCallback` writes them next to each checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from st_ext.losses.cross_batch_memory import MEMORY_STATE_FORMAT, CrossBatchMemoryLoss

logger = logging.getLogger(__name__)

MEMORY_FILENAME = "cross_batch_memory.pt"


def memory_losses(loss: nn.Module | dict[str, nn.Module] | None) -> dict[str, CrossBatchMemoryLoss]:
    """Every CrossBatchMemoryLoss inside a trainer's loss (one module, or a dict per dataset), by a
    name that stays the same between runs of the same script."""
    roots = loss.items() if isinstance(loss, dict) else [("", loss)]
    found = {}
    for root_name, root in roots:
        if not isinstance(root, nn.Module):
            continue
        for name, module in root.named_modules():
            if isinstance(module, CrossBatchMemoryLoss):
                found[".".join(part for part in (root_name, name) if part) or "loss"] = module
    return found


def save_memories(loss: nn.Module | dict[str, nn.Module], checkpoint_dir: str | Path) -> Path | None:
    """Write every memory in ``loss`` to ``checkpoint_dir/cross_batch_memory.pt``; None if there is none."""
    found = memory_losses(loss)
    if not found:
        return None
    path = Path(checkpoint_dir) / MEMORY_FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": MEMORY_STATE_FORMAT, "losses": {name: m.memory_state() for name, m in found.items()}}, path)
    return path


class MissingMemoryError(FileNotFoundError):
    """A checkpoint to resume from lacks a cross-batch memory the loss holds."""


def load_memories(
    loss: nn.Module | dict[str, nn.Module], checkpoint_dir: str | Path, *, allow_empty: bool = False
) -> list[str]:
    """Restore the memories saved by :func:`save_memories`; returns the names restored.

    A memory the checkpoint lacks would resume empty and the run would diverge from the uninterrupted
    one: a :class:`MissingMemoryError`, unless ``allow_empty`` (then a warning). An unreadable file (say,
    truncated by a full disk) is a ``ValueError`` naming it.
    """
    found = memory_losses(loss)
    if not found:
        return []
    path = Path(checkpoint_dir) / MEMORY_FILENAME
    saved: dict[str, Any] = {}
    if path.is_file():
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)["losses"]
        except Exception as error:  # torch.load raises several types for a damaged file
            raise ValueError(
                f"{path} cannot be read ({error}): the cross-batch memory of that checkpoint is damaged. Resume from "
                "another checkpoint."
            ) from error
    missing = sorted(found.keys() - saved.keys())
    if missing:
        where = f"{path} holds no memory for {', '.join(map(repr, missing))}" if saved else f"{path} does not exist"
        if not allow_empty:
            raise MissingMemoryError(
                f"{where}: resuming would train on with an empty cross-batch memory and diverge from the "
                "uninterrupted run. Resume from a checkpoint that has it, or pass resume_empty_memory=True to the "
                "trainer to start the memory empty."
            )
        logger.warning(f"{where}: the cross-batch memory starts empty (resume_empty_memory=True).")
    restored = sorted(found.keys() & saved.keys())
    for name in restored:
        found[name].load_memory_state(saved[name])
    return restored


class CrossBatchMemoryCallback(TrainerCallback):
    """Saves the memory of every CrossBatchMemoryLoss in ``loss`` next to each checkpoint of an upstream trainer.

    ``on_save`` runs after the trainer wrote the checkpoint and rotated older ones, so a kill in between
    leaves a checkpoint without its memory (resuming from it is then an error); st_ext's trainers write
    the memory inside the checkpoint instead and need no callback. Only the main process writes: every
    rank holds the same queue.
    """

    def __init__(self, loss: nn.Module | dict[str, nn.Module]) -> None:
        self.loss = loss

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            save_memories(self.loss, Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        return control


def restore_memories_for_resume(
    trainer, resume_from_checkpoint: str | bool | None, *, allow_empty: bool = False
) -> list[str]:
    """Before ``train(resume_from_checkpoint=...)``: load the memories saved with that checkpoint
    (``True``: the last one in ``args.output_dir``, as the trainer resolves it); see :func:`load_memories`."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return []
    checkpoint: str | None
    if resume_from_checkpoint is True:
        checkpoint = get_last_checkpoint(trainer.args.output_dir)
        if checkpoint is None:
            return []  # the trainer raises its own error about the missing checkpoint
    else:
        checkpoint = resume_from_checkpoint
    return load_memories(trainer.loss, checkpoint, allow_empty=allow_empty)
