"""A cross-batch memory joined to a ranking loss: queued documents (and anchors) as extra candidates.

Every step of a memory around (Cached)MultipleNegativesRankingLoss is scored by
:func:`~st_ext.losses.masked_ranking.masked_ranking_loss` with the wrapped loss's settings, whatever the batch
holds: one scoring, chosen when the memory is built, that also masks per anchor (repeated positives,
``document_ids``) and scores a query bank and every ``directions`` option, and that equals upstream's with
nothing to mask (tests/test_masked_ranking.py). A subclass that overrides upstream's scoring is refused.

The queue joins the step as data (:class:`RankingQueue`, a :class:`~st_ext.losses.loss_functions.BatchJoin`):
two detached candidate columns per output (the queued documents, the queued anchors), and the document id
of each of their rows, both taken from the queue of the output's source, so that a layer ranks against its
own layer's queue with its own ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from st_ext._compat import ST_VERSION, ranking_directions
from st_ext.losses.features import Features, batch_size_of
from st_ext.losses.gradcache import LossStep
from st_ext.losses.loss_functions import Reps, Source
from st_ext.losses.masked_ranking import (
    CandidateIds,
    check_scoring_options,
    masked_ranking_loss,
    refuse_scoring_overrides,
)
from st_ext.losses.memory_bank import MemoryBank, document_keys, memory_like
from st_ext.losses.same_document import NO_DOCUMENT, batch_document_ids

if TYPE_CHECKING:
    from st_ext.losses.cross_batch_memory import CrossBatchMemoryLoss

#: The directions of upstream's MNRL in which queries are candidates: where a query bank is scored.
QUERY_DIRECTIONS = ("query_to_query", "doc_to_query")


def check_ranking_options(loss: nn.Module, query_bank: bool) -> None:
    """Refuse the MNRL options and subclasses a memory's scoring cannot carry."""
    check_scoring_options(loss, "CrossBatchMemoryLoss")
    if getattr(loss, "gather_across_devices", False):
        raise ValueError(
            "CrossBatchMemoryLoss does not support gather_across_devices=True on the wrapped MNRL (the memory already "
            "holds every rank's documents of earlier steps): set gather_across_devices=False."
        )
    refuse_scoring_overrides(loss, "CrossBatchMemoryLoss")
    if not query_bank:
        return
    # A query bank needs a direction that scores queries as candidates.
    directions = ranking_directions(loss)
    if directions is None:
        raise ValueError(
            f"query_bank=True needs the directions option of {type(loss).__name__} ('query_to_query', "
            f"'doc_to_query'), which sentence-transformers {ST_VERSION} lacks: upgrade it, or leave query_bank off."
        )
    if not set(QUERY_DIRECTIONS) & set(directions):
        raise ValueError(
            f"query_bank=True adds earlier anchors to the 'query_to_query' and 'doc_to_query' directions, and the "
            f"wrapped loss scores neither (directions={directions}): add one of them to its directions."
        )


def ranking_keys(loss: nn.Module, sentence_features: list[Features]) -> Tensor:
    """The key of every document row (:func:`~st_ext.losses.memory_bank.document_keys`), in the order the
    documents are enqueued."""
    if len(sentence_features) < 2:
        raise ValueError(
            f"{type(loss).__name__} needs (anchor, positive, negative_1, ...) columns, got {len(sentence_features)} column(s)."
        )
    return torch.cat([document_keys(features) for features in sentence_features[1:]])


def ranking_step(memory: CrossBatchMemoryLoss, sentence_features: list[Features], chunk_size: int) -> LossStep:
    """One step of ``memory`` around a ranking loss: the queue joined, scored ``chunk_size`` anchors at a time."""
    queue = RankingQueue(memory, sentence_features, torch.is_grad_enabled())
    return LossStep(partial(QueueScoring, queue, chunk_size=chunk_size), join=queue)


class RankingQueue:
    """One step's view of a ranking memory's queues (a :class:`~st_ext.losses.loss_functions.BatchJoin`).

    What a step ranks against is fixed by the queues as they were when it started: by token ids, queued copies
    of the batch's documents (and, in the query bank, of its anchors' positives) are dropped for every anchor
    (``mask_own_positive``); by document ids the scoring masks them per anchor instead. Outside training
    (gradients off) nothing is queued or read."""

    def __init__(self, memory: CrossBatchMemoryLoss, sentence_features: list[Features], training: bool) -> None:
        self.memory = memory
        self.sentence_features = sentence_features
        self.training = training
        #: The key of every document row (columns after the anchors, in order).
        self.keys = ranking_keys(memory.loss, sentence_features)
        self.rows = batch_size_of(sentence_features[0])
        self._queued: dict[Source, tuple[MemoryBank, MemoryBank]] = {}

    def queued(self, source: Source) -> tuple[MemoryBank, MemoryBank]:
        """The queued documents and the queued anchors ``source``'s output ranks against."""
        if source not in self._queued:
            memory, by_token_ids = self.memory, self.memory.mask_own_positive and self.memory.document_ids is None
            documents, queries = MemoryBank(), MemoryBank()
            if self.training:
                documents = memory.bank(source).without(self.keys if by_token_ids else None)
            if self.training and memory.query_bank:
                queries = memory.bank(source, queries=True).without(self.keys[: self.rows] if by_token_ids else None)
            self._queued[source] = (documents, queries)
        return self._queued[source]

    def columns(self, source: Source, like: Tensor) -> Reps:
        """The queued documents and the queued anchors as two candidate columns on ``like``'s device and dtype."""
        return [[memory_like(bank, like)[0] if bank.rows else like[:0].detach()] for bank in self.queued(source)]

    def anchor_ids(self, labels: Tensor | None) -> Tensor | None:
        """Each row's document id, with ``document_ids``; else None."""
        if self.memory.document_ids is None:
            return None
        ids = batch_document_ids(self.memory.document_ids, self.sentence_features, labels, self.rows)
        return ids.to(self.keys.device)

    def candidate_ids(self, source: Source, labels: Tensor | None) -> CandidateIds:
        """The document ids of ``source``'s candidates, in :meth:`columns`' order: each row's (its document id,
        or by token ids its positive's key when ``mask_own_positive``; else none), each document column's, and
        the queued rows' (by token ids none: the copies are dropped)."""
        device, columns = self.keys.device, len(self.keys) // max(self.rows, 1)

        def unknown(count: int) -> Tensor:
            return torch.full((count,), NO_DOCUMENT, dtype=torch.int64, device=device)

        documents, queries = self.queued(source)
        anchors = self.anchor_ids(labels)
        if anchors is not None:
            column_ids = [anchors] + [unknown(self.rows)] * (columns - 1)
            queued = [unknown(0) if not documents.rows else documents.document_ids.to(device)]
            queued.append(unknown(0) if not queries.rows else queries.labels.to(device))
            return CandidateIds(anchors, column_ids, *queued)
        queued = [unknown(documents.rows), unknown(queries.rows)]
        if self.memory.mask_own_positive:
            return CandidateIds(self.keys[: self.rows], list(self.keys.split(self.rows)), *queued)
        return CandidateIds(unknown(self.rows), [unknown(self.rows)] * columns, *queued)

    def after_step(self, sources: list[Source], outputs: list[Reps], labels: Tensor | None) -> None:
        """Enqueue the step's documents (and anchors, with a query bank) into each source's queues."""
        if not self.training:
            return
        anchor_labels, document_ids = self.keys[: self.rows], None
        anchors = self.anchor_ids(labels)
        if anchors is not None:
            anchor_labels = anchors
            document_ids = torch.cat([anchors] + [torch.full_like(anchors, NO_DOCUMENT)] * (len(outputs[0]) - 2))
        self.memory.check_same_sources_on_every_rank(sources)
        for source, reps in zip(sources, outputs):
            documents = torch.cat([torch.cat(column) for column in reps[1:]])
            self.memory.push(source, documents, self.keys, document_ids)
            if self.memory.query_bank:
                self.memory.push(source, torch.cat(reps[0]), anchor_labels, queries=True)


@dataclass(frozen=True)
class QueueScoring:
    """The loss function of one output under a ranking memory (:data:`~st_ext.losses.loss_functions.LossFn`):
    the wrapped loss's settings, with the ids of that output's queue."""

    queue: RankingQueue
    source: Source
    chunk_size: int

    def __call__(self, reps: Reps, labels: Tensor | None, *, with_backward: bool) -> Tensor:
        ids = self.queue.candidate_ids(self.source, labels)
        return masked_ranking_loss(
            self.queue.memory.loss, reps, ids, chunk_size=self.chunk_size, with_backward=with_backward
        )
