"""A cross-batch memory joined to a ranking loss: queued documents (and anchors) as extra candidates.

Every step of a memory around (Cached)MultipleNegativesRankingLoss is scored by
:func:`~st_ext.losses.masked_ranking.masked_ranking_loss` with the wrapped loss's settings, whatever the batch
holds: one scoring, chosen when the memory is built, that also masks per anchor (repeated positives,
``document_ids``) and scores a query bank and every ``directions`` option, and that equals upstream's with
nothing to mask (tests/test_masked_ranking.py). A subclass that overrides upstream's scoring is refused.

The queue joins the step as data (:class:`RankingQueue`, a :class:`~st_ext.losses.loss_functions.BatchJoin`):
two detached candidate columns per output (the queued documents, the queued anchors), and the document keys
of each of their rows, both taken from the queue of the output's source, so that a layer ranks against its
own layer's queue with its own keys.
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
from st_ext.losses.same_document import NO_DOCUMENT, StepDocumentIds

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
        self.training = training
        #: The key of every document row (columns after the anchors, in order).
        self.keys = ranking_keys(memory.loss, sentence_features)
        self.rows = batch_size_of(sentence_features[0])
        #: Per column, each row's document keys, with ``document_ids`` (:mod:`st_ext.losses.same_document`).
        self.document_ids = StepDocumentIds(memory.document_ids, sentence_features)
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
        columns: Reps = []
        for bank in self.queued(source):
            queued_embeddings, _ = memory_like(bank, like)
            columns.append([like[:0].detach() if queued_embeddings is None else queued_embeddings])
        return columns

    def candidate_ids(self, source: Source, labels: Tensor | None) -> CandidateIds:
        """The document keys of ``source``'s candidates, in :meth:`columns`' order: with ``document_ids``, each
        column's and the queued rows'; else by token ids when ``mask_own_positive`` (an anchor carries its
        positive's key, a document its own, a queued row none: the copies are dropped); else none."""
        documents, queries = self.queued(source)
        column_ids = self.document_ids(labels)
        if column_ids is not None:
            nothing = column_ids[0][:0]
            queued = [
                nothing if bank.document_ids is None or not bank.rows else bank.document_ids.to(nothing.device)
                for bank in (documents, queries)
            ]
            return CandidateIds(column_ids[0], column_ids[1:], *queued)
        device, columns = self.keys.device, len(self.keys) // max(self.rows, 1)
        if not self.memory.mask_own_positive:
            return CandidateIds.unmasked(self.rows, columns, documents.rows, queries.rows, device)

        def unknown(count: int) -> Tensor:
            return torch.full((count, 1), NO_DOCUMENT, dtype=torch.int64, device=device)

        keys = self.keys.unsqueeze(1)
        return CandidateIds(
            keys[: self.rows], list(keys.split(self.rows)), unknown(documents.rows), unknown(queries.rows)
        )

    def after_step(self, sources: list[Source], outputs: list[Reps], labels: Tensor | None) -> None:
        """Enqueue the step's documents (and anchors, with a query bank) into each source's queues: a queued
        anchor is labelled with its positive's key, and with ``document_ids`` every queued row keeps its keys."""
        if not self.training:
            return
        column_ids = self.document_ids(labels)
        document_ids = anchor_ids = None
        if column_ids is not None:
            document_ids, anchor_ids = torch.cat(column_ids[1:]), column_ids[0]
        self.memory.check_same_sources_on_every_rank(sources)
        for source, reps in zip(sources, outputs):
            documents = torch.cat([torch.cat(column) for column in reps[1:]])
            self.memory.push(source, documents, self.keys, document_ids)
            if self.memory.query_bank:
                self.memory.push(source, torch.cat(reps[0]), self.keys[: self.rows], anchor_ids, queries=True)


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
