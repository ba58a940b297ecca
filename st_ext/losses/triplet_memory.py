"""A cross-batch memory joined to a batch triplet loss: queued rows and their labels as extra references.

Batch-all, batch-hard and semi-hard (st_ext's, upstream's, and their subclasses that keep upstream's
computation) compare every anchor of the batch with the batch followed by the queue
(:func:`~st_ext.losses.triplet.triplet_loss_from_embeddings`). The queue joins the step as one detached
column per output (:class:`TripletQueue`), its labels read from the queue of the same source.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from st_ext.losses.features import Features
from st_ext.losses.gradcache import LossStep
from st_ext.losses.loss_functions import Reps, Source
from st_ext.losses.memory_bank import memory_like
from st_ext.losses.triplet import check_triplet_labels, triplet_loss_from_embeddings, triplet_settings

if TYPE_CHECKING:
    from st_ext.losses.cross_batch_memory import CrossBatchMemoryLoss


def triplet_step(memory: CrossBatchMemoryLoss, sentence_features: list[Features]) -> LossStep:
    """One step of ``memory`` around a triplet loss."""
    if len(sentence_features) != 1:
        raise ValueError(
            f"{type(memory.loss).__name__} takes one text column and a label column, got {len(sentence_features)} "
            "text columns."
        )
    queue = TripletQueue(memory, torch.is_grad_enabled())
    return LossStep(partial(TripletScoring, queue), join=queue)


class TripletQueue:
    """One step's view of a triplet memory's queues (a :class:`~st_ext.losses.loss_functions.BatchJoin`);
    outside training (gradients off) nothing is queued or read."""

    def __init__(self, memory: CrossBatchMemoryLoss, training: bool) -> None:
        self.memory = memory
        self.training = training

    def columns(self, source: Source, like: Tensor) -> Reps:
        queued, _ = memory_like(self.memory.bank(source), like)
        return [[like[:0].detach() if queued is None or not self.training else queued]]

    def queued_labels(self, source: Source, device: torch.device) -> Tensor | None:
        bank = self.memory.bank(source)
        if not (self.training and bank.rows) or bank.labels is None:
            return None
        return bank.labels.to(device)

    def labels_of(self, labels: Tensor | None, rows: int) -> Tensor:
        return check_triplet_labels(labels, rows, f"CrossBatchMemoryLoss around {type(self.memory.loss).__name__}")

    def after_step(self, sources: list[Source], outputs: list[Reps], labels: Tensor | None) -> None:
        if not self.training:
            return
        self.memory.check_same_sources_on_every_rank(sources)
        for source, reps in zip(sources, outputs):
            rows = torch.cat(reps[0])
            self.memory.push(source, rows, self.labels_of(labels, len(rows)))


@dataclass(frozen=True)
class TripletScoring:
    """The loss function of one output under a triplet memory: the batch's rows, then the queue's, as references."""

    queue: TripletQueue
    source: Source

    def __call__(self, reps: Reps, labels: Tensor | None, *, with_backward: bool) -> Tensor:
        settings = triplet_settings(self.queue.memory.loss)
        assert settings is not None, "a memory joins a triplet loss only when it has triplet settings"
        loss_function, distance_metric, margin = settings
        embeddings, queued = torch.cat(reps[0]), torch.cat(reps[1])
        value = triplet_loss_from_embeddings(
            loss_function,
            distance_metric,
            margin,
            embeddings,
            self.queue.labels_of(labels, len(embeddings)),
            queued,
            self.queue.queued_labels(self.source, embeddings.device),
        )
        if with_backward:
            value.backward()
            value = value.detach()
        return value
