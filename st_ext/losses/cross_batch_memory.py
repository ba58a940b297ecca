"""Cross-batch memory (XBM, https://huggingface.co/papers/1912.06798) for sentence-transformers losses.

A FIFO queue of detached embeddings from earlier training steps joins every step's loss: for
(Cached)MultipleNegativesRankingLoss the queued documents are one more column of candidates handed to
the wrapped loss's own scoring (:class:`RankingMemory`); for the triplet losses the queued rows and their
labels extend the batch's references (:class:`TripletMemory`).
The step's rows are enqueued after the loss (queued first, the batch's own positives would come back
as negatives), detached and, under DDP, gathered from every rank. Gradients reach the batch only, and
a cached loss stays exact: the queue is a constant in its loss over embeddings (GradCache's step 2),
and the replay (step 3) never looks at it.

Ranking losses queue documents (the positive and hard-negative columns), not anchors: they are what
anchors are ranked against, and queries may be embedded differently (prompts, asymmetric models). A
queued copy of an anchor's own positive (the same text again, in a later epoch or for another query)
would be a false negative with a near-perfect score; ``mask_own_positive`` leaves every queued copy of
any of the batch's documents out of the step's candidates (the wrapped loss scores one candidate set
for all anchors), recognising rows by a hash of their non-padding token ids, stored in place of a
label. Queued embeddings come from older parameters: XBM finds they drift slowly enough, so size the
queue in steps (``memory_size`` ≈ documents per step × a few hundred steps).

With ``query_bank=True`` the anchors are queued too (ContAccum), candidates in the wrapped loss's
``query_to_query`` and ``doc_to_query`` directions; with ``document_ids`` every candidate of an anchor's
own document is masked for it (:mod:`st_ext.losses.same_document`), and a copy of a row's positive
elsewhere in the batch is never its negative. Upstream's scoring takes none of these, so such a step is
scored by :func:`~st_ext.losses.masked_ranking.masked_ranking_loss` with the wrapped loss's settings.

The queue is read and written only when gradients are enabled (training steps); evaluation computes
the plain loss. st_ext's trainer saves it in every checkpoint and restores it on resume (a checkpoint
without it is an error); with an upstream trainer, :class:`CrossBatchMemoryCallback` saves it.
"""

from __future__ import annotations

import hashlib
import logging
import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from st_ext._compat import (
    ST_VERSION,
    is_gradient_caching,
    loss_model,
    ranking_directions,
    ranking_loss_from_embeddings,
    st_losses,
    upstream_loss_class,
)
from st_ext.losses.cached_loss import CachedLoss, LossStep, with_loss
from st_ext.losses.cached_ranking import CachedMultipleNegativesSymmetricRankingLoss
from st_ext.losses.gathering import gather_from_ranks
from st_ext.losses.gradcache import Features, Reps, batch_size_of, gradcache_forward, row_keys
from st_ext.losses.loss_descriptions import as_cached_loss
from st_ext.losses.masked_ranking import CandidateIds, masked_ranking_loss
from st_ext.losses.same_document import (
    NO_DOCUMENT,
    DocumentIds,
    batch_document_ids,
    check_document_ids,
    same_document,
)
from st_ext.losses.triplet import check_triplet_labels, triplet_loss_from_embeddings, triplet_settings

logger = logging.getLogger(__name__)

MEMORY_FILENAME = "cross_batch_memory.pt"
DEFAULT_MEMORY_SIZE = 1024
MEMORY_STATE_FORMAT = 1
#: Upstream's ranking losses that also rank documents against queries, which a memory of documents cannot.
SYMMETRIC_RANKING_LOSSES = ("MultipleNegativesSymmetricRankingLoss", "CachedMultipleNegativesSymmetricRankingLoss")
#: The directions of upstream's MNRL in which queries are candidates: where a query bank is scored.
QUERY_DIRECTIONS = ("query_to_query", "doc_to_query")

XBM_CITATION = """
@inproceedings{wang2020xbm,
    title={Cross-Batch Memory for Embedding Learning},
    author={Xun Wang and Haozhi Zhang and Weilin Huang and Matthew R. Scott},
    booktitle={Proceedings of the IEEE/CVF Conference on Computer Vision and Pattern Recognition (CVPR)},
    year={2020},
    eprint={1912.06798},
    archivePrefix={arXiv}
}
"""


# ---------------------------------------------------------------------------------------------
# The queue


@dataclass(frozen=True)
class MemoryBank:
    """The queue: rows oldest first, never part of a graph. ``labels`` are class labels (triplet losses)
    or document keys (ranking losses, :func:`document_keys`); ``document_ids``, where the loss masks by
    document, the document id of each row (:mod:`st_ext.losses.same_document`).

    Updates build a new bank rather than write into this one: the graph of the step that read it may
    still need its tensors for the backward pass.
    """

    embeddings: Tensor | None = None
    labels: Tensor | None = None
    document_ids: Tensor | None = None

    @property
    def rows(self) -> int:
        return 0 if self.embeddings is None else len(self.embeddings)


def check_fits(queued: Tensor, embeddings: Tensor) -> None:
    """A size mismatch would otherwise surface as an unexplained shape error inside a matrix product."""
    if embeddings.shape[-1] != queued.shape[-1]:
        raise ValueError(
            f"The cross-batch memory holds {queued.shape[-1]}-dimensional embeddings, but this batch's "
            f"embeddings have {embeddings.shape[-1]} dimensions. The embedding size changed mid-run (a truncating "
            "wrapper such as MatryoshkaLoss around the memory, or a different model): keep one embedding size per "
            "CrossBatchMemoryLoss, or call reset_memory() when switching on purpose."
        )


def memory_like(bank: MemoryBank, embeddings: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """The queue on the batch's device and in its dtype, or (None, None) when it is empty."""
    if not bank.rows:
        return None, None
    check_fits(bank.embeddings, embeddings)
    return bank.embeddings.to(device=embeddings.device, dtype=embeddings.dtype), bank.labels.to(embeddings.device)


def enqueue(
    bank: MemoryBank, embeddings: Tensor, labels: Tensor, memory_size: int, document_ids: Tensor | None = None
) -> MemoryBank:
    """A new bank: the old rows followed by these (detached, in the bank's dtype, on their own device),
    keeping the newest ``memory_size``."""
    new = [embeddings.detach(), labels.detach()] + ([] if document_ids is None else [document_ids.detach()])
    if any(len(part) != len(new[0]) for part in new[1:]):
        raise ValueError(f"{len(embeddings)} embeddings to enqueue but {len(labels)} labels.")
    if bank.rows:
        check_fits(bank.embeddings, embeddings)
        if (bank.document_ids is None) != (document_ids is None):
            raise ValueError("Rows with and without document ids cannot share a cross-batch memory.")
        old = [bank.embeddings, bank.labels] + ([] if document_ids is None else [bank.document_ids])
        new = [part.to(old_part.dtype) for part, old_part in zip(new, old)]
    else:
        old = [part[:0] for part in new]
    keep_new = min(len(new[0]), memory_size)
    keep_old = min(len(old[0]), memory_size - keep_new)
    kept = [
        torch.cat([old_part.to(part.device)[len(old_part) - keep_old :], part[len(part) - keep_new :]])
        for part, old_part in zip(new, old)
    ]
    return MemoryBank(*kept)


def document_keys(features: Features) -> Tensor:
    """One int64 key per row: a hash of its non-padding token ids, so that the same text gets the same
    key in any batch, whatever its padding. -1 (never a real key, which is >= 0) for every row when the
    features carry no token ids."""
    input_ids = features.get("input_ids")
    if not isinstance(input_ids, Tensor) or input_ids.ndim != 2:
        any_tensor = next((v for v in features.values() if isinstance(v, Tensor)), None)
        device = None if any_tensor is None else any_tensor.device
        return torch.full((batch_size_of(features),), -1, dtype=torch.int64, device=device)
    keys = [
        int.from_bytes(hashlib.blake2b(row_key, digest_size=8).digest(), "little") >> 1
        for row_key in row_keys(features)
    ]
    return torch.tensor(keys, dtype=torch.int64, device=input_ids.device)


# ---------------------------------------------------------------------------------------------
# Ranking losses: queued documents as extra candidates


def check_ranking_options(loss: nn.Module) -> None:
    """Refuse the MNRL options whose meaning extra candidates without their queries cannot carry."""
    if getattr(loss, "hardness_mode", None) is not None and getattr(loss, "hardness_strength", 0.0) > 0:
        raise ValueError(
            "CrossBatchMemoryLoss does not support hardness_mode/hardness_strength on the wrapped MNRL (queued "
            "documents belong to no query of the batch): leave them at their defaults."
        )
    if getattr(loss, "gather_across_devices", False):
        raise ValueError(
            "CrossBatchMemoryLoss does not support gather_across_devices=True on the wrapped MNRL (the memory already "
            "holds every rank's documents of earlier steps): set gather_across_devices=False."
        )


def check_query_bank(loss: nn.Module) -> None:
    """A query bank needs a direction that scores queries as candidates."""
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
    """The key of every document row (:func:`document_keys`), in the order the documents are enqueued."""
    if len(sentence_features) < 2:
        raise ValueError(
            f"{type(loss).__name__} needs (anchor, positive, negative_1, ...) columns, got {len(sentence_features)} column(s)."
        )
    return torch.cat([document_keys(features) for features in sentence_features[1:]])


def document_rows(reps: Reps) -> Tensor:
    """The documents of a ranking batch: every column after the anchors."""
    return torch.cat([torch.cat(column) for column in reps[1:]])


def queued_candidates(bank: MemoryBank, anchors: Tensor, batch_keys: Tensor | None) -> Reps:
    """The queue as one extra (detached) candidate column for a batch with these anchors, or no column
    when it is empty. With ``batch_keys`` (the batch's documents'), a queued row with the key of any of
    them is left out: a queued copy of a row's own positive would be a false negative."""
    queued, queued_keys = memory_like(bank, anchors)
    if queued is None:
        return []
    if batch_keys is not None:
        queued = queued[~torch.isin(queued_keys, batch_keys.to(queued_keys.device))]
    return [[queued]] if len(queued) else []


@dataclass(frozen=True)
class BatchDocuments:
    """What a ranking step knows of its batch before any embedding: the key of every document row (columns
    after the anchors, in order) and the number of rows."""

    keys: Tensor
    rows: int

    @property
    def positive_keys(self) -> Tensor:
        return self.keys[: self.rows]

    def repeats_a_positive(self) -> bool:
        """Whether some row's positive comes back elsewhere in the batch (a repeated row, or the same text
        paired with another query): upstream's scoring would count it as a negative of that row."""
        copies = same_document(self.positive_keys, self.keys)
        rows = torch.arange(self.rows, device=self.keys.device)
        copies[rows, rows] = False
        return bool(copies.any())


class RankingMemory:
    """A queue of documents (and, with a query bank, of anchors) for a ranking loss
    (MultipleNegativesRankingLoss, its cached forms and their subclasses).

    Queued documents are handed to the wrapped loss's own scoring as one more column of candidates, so
    every option it has runs as it does without a memory. Where that scoring cannot say it (a query bank,
    candidates masked per anchor, directions other than ``query_to_doc``), the memory scores with
    :func:`~st_ext.losses.masked_ranking.masked_ranking_loss`, which follows the wrapped loss's settings."""

    def __init__(self, loss: nn.Module) -> None:
        check_ranking_options(loss)
        self.loss = loss

    def forward(
        self, memory: CrossBatchMemoryLoss, sentence_features: list[Features], labels: Tensor | None
    ) -> Tensor:
        """A step of a loss that embeds the batch in one pass (MultipleNegativesRankingLoss)."""
        batch = BatchDocuments(ranking_keys(self.loss, sentence_features), batch_size_of(sentence_features[0]))
        training = torch.is_grad_enabled()
        embeddings = [memory.model(features)["sentence_embedding"] for features in sentence_features]
        reps = [[column] for column in embeddings]
        if memory.scores_itself(batch):
            ids = memory.candidate_ids(batch, sentence_features, labels, training)
            columns = memory.queued_columns(None, embeddings[0], batch, training)
            value = masked_ranking_loss(
                self.loss, reps + columns, ids, chunk_size=max(batch.rows, 1), with_backward=False
            )
        else:
            added = (
                queued_candidates(memory.bank(None), embeddings[0], memory.dropped_keys(batch.keys))
                if training
                else []
            )
            value = ranking_loss_from_embeddings(
                self.loss, embeddings + [torch.cat(column) for column in added], labels
            )
        if training:
            memory.enqueue_batch(None, reps, batch, sentence_features, labels)
        return value

    def cached_loss(self, memory: CrossBatchMemoryLoss) -> CachedLoss:
        inner = as_cached_loss(self.loss)
        if inner is None:
            raise not_wrappable(self.loss)
        return with_queue(memory, inner)


def with_queue(memory: CrossBatchMemoryLoss, description: CachedLoss) -> CachedLoss:
    """The cached ranking loss ``description`` with ``memory``'s queues: every output's reps get the queue of
    its source (the model's output, or a layer a layer-wise loss embeds) as one more candidate column, and
    once the step's loss is computed each source's documents join its queue. The documents enqueued are
    step (1)'s embeddings: with the RNG replayed they are the ones the gradients were computed for.

    Each layer has its own queue: one for all layers would put final-layer embeddings among an earlier
    layer's candidates, another embedding space. A layer's queue grows only on steps that sample it (with
    ``n_layers_per_step=1`` of L layers, about L times more slowly, so its rows are older), and every queue
    holds up to ``memory_size`` rows: (sampled layers + 1) × ``memory_size`` embeddings in all.

    Where the memory scores itself (:class:`RankingMemory`), every output gets two columns, the queued
    documents and the queued anchors (either may have no rows), and the loss over embeddings is
    :func:`~st_ext.losses.masked_ranking.masked_ranking_loss` at the engine's mini-batch size."""

    def queued(step: LossStep, sentence_features: list[Features], ranges, mini_batch_size: int) -> LossStep:
        batch = BatchDocuments(ranking_keys(memory.loss, sentence_features), batch_size_of(sentence_features[0]))
        training = torch.is_grad_enabled()
        scores_itself = memory.scores_itself(batch)
        #: The labels the step's loss saw (the document ids may be read from them when the batch is enqueued).
        seen_labels: list[Tensor | None] = []

        def candidates(sources: list, outputs: list[Reps]) -> list[Reps]:
            added = step.candidates(sources, outputs)
            if scores_itself:
                return [
                    columns + memory.queued_columns(source, torch.cat(reps[0]), batch, training)
                    for columns, source, reps in zip(added, sources, outputs)
                ]
            if not training:
                return added
            return [
                columns + queued_candidates(memory.bank(source), torch.cat(reps[0]), memory.dropped_keys(batch.keys))
                for columns, source, reps in zip(added, sources, outputs)
            ]

        def loss_fn(reps: Reps, labels: Tensor | None, *, with_backward: bool) -> Tensor:
            seen_labels[:] = [labels]
            ids = memory.candidate_ids(batch, sentence_features, labels, training)
            return masked_ranking_loss(memory.loss, reps, ids, chunk_size=mini_batch_size, with_backward=with_backward)

        def finish(sources: list, outputs: list[Reps]) -> None:
            step.finish(sources, outputs)
            if not training:
                return
            if sources != [None]:
                _check_same_layers_on_every_rank(sources)
            labels = seen_labels[0] if seen_labels else None
            for source, reps in zip(sources, outputs):
                memory.enqueue_batch(source, reps, batch, sentence_features, labels)

        if scores_itself:
            return replace(step, candidates=candidates, finish=finish, draw=lambda: loss_fn)
        return replace(step, candidates=candidates, finish=finish)

    return with_loss(description, type(memory).__name__, queued)


def _check_same_layers_on_every_rank(layers: list) -> None:
    """Ranks that drew different layers (Python's ``random`` seeded differently) would mix layers in one
    queue without any shape error."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    drawn: list = [None] * dist.get_world_size()
    dist.all_gather_object(drawn, layers)
    if any(other != layers for other in drawn):
        raise RuntimeError(
            f"The ranks sampled different layers ({drawn}): each layer's cross-batch memory would mix them. Seed "
            "Python's random module alike on every rank (the Trainer's seed does), or set n_layers_per_step=-1."
        )


# ---------------------------------------------------------------------------------------------
# Triplet losses: queued rows as extra references


class TripletMemory:
    """A queue of labelled rows for a batch triplet loss (batch-all, batch-hard, semi-hard; st_ext's, upstream's
    and their subclasses that keep upstream's computation): queued rows and their labels extend the
    references every anchor of the batch is compared with."""

    def __init__(self, loss: nn.Module) -> None:
        self.loss = loss
        self.loss_function, self.distance_metric, self.margin = triplet_settings(loss)

    def forward(
        self, memory: CrossBatchMemoryLoss, sentence_features: list[Features], labels: Tensor | None
    ) -> Tensor:
        if len(sentence_features) != 1:
            raise ValueError(
                f"{type(self.loss).__name__} takes one text column and a label column, got {len(sentence_features)} "
                "text columns."
            )
        training = torch.is_grad_enabled()
        embeddings = memory.model(sentence_features[0])["sentence_embedding"]
        what = f"CrossBatchMemoryLoss around {type(self.loss).__name__}"
        labels = check_triplet_labels(labels, len(embeddings), what)
        queued, queued_labels = memory_like(memory.bank(None) if training else MemoryBank(), embeddings)
        value = triplet_loss_from_embeddings(
            self.loss_function, self.distance_metric, self.margin, embeddings, labels, queued, queued_labels
        )
        if training:
            memory.push(None, embeddings, labels)
        return value

    def cached_loss(self, memory: CrossBatchMemoryLoss) -> CachedLoss:
        raise not_wrappable(self.loss)


def not_wrappable(loss: nn.Module) -> TypeError:
    """The error of a wrapper around a memory whose loss is not on st_ext's engine."""
    return TypeError(
        f"Wrappers take a CrossBatchMemoryLoss over CachedMultipleNegativesRankingLoss only (st_ext then gives each "
        f"layer its own queue and truncates the queue with the batch), not over {type(loss).__name__}: called once "
        "per dimension or layer, the memory would mix their embeddings in one queue. For MultipleNegativesRankingLoss "
        "use CachedMultipleNegativesRankingLoss; with mini_batch_size at least the batch size it runs in one pass."
    )


def memory_for(loss: nn.Module) -> RankingMemory | TripletMemory:
    """How a queue joins ``loss``, or an error naming the losses a memory supports."""
    upstream = st_losses()
    symmetric = tuple(filter(None, map(upstream_loss_class, SYMMETRIC_RANKING_LOSSES))) + (
        CachedMultipleNegativesSymmetricRankingLoss,
    )
    if isinstance(loss, symmetric):
        raise TypeError(
            f"CrossBatchMemoryLoss cannot wrap {type(loss).__name__}: Symmetric variants rank queries against "
            "documents and back, and the memory holds no queries. Use (Cached)MultipleNegativesRankingLoss."
        )
    ranking = (upstream.MultipleNegativesRankingLoss, upstream.CachedMultipleNegativesRankingLoss)
    if isinstance(loss, ranking):
        return RankingMemory(loss)
    if triplet_settings(loss) is not None:
        return TripletMemory(loss)
    raise TypeError(
        f"CrossBatchMemoryLoss cannot wrap {type(loss).__name__}. Supported: MultipleNegativesRankingLoss, "
        "CachedMultipleNegativesRankingLoss (queued documents become extra negatives), BatchAllTripletLoss, "
        "BatchHardTripletLoss, BatchSemiHardTripletLoss (queued rows become extra references), and their "
        "subclasses. Symmetric variants are not supported: the memory holds no queries."
    )


# ---------------------------------------------------------------------------------------------
# The loss


class CrossBatchMemoryLoss(nn.Module):
    """A loss that also sees the embeddings of the last ``memory_size`` rows from earlier steps.

    Args:
        model: the SentenceTransformer being trained (the one ``loss`` was built with).
        loss: MultipleNegativesRankingLoss or CachedMultipleNegativesRankingLoss (queued documents
            become extra candidates of the loss's own scoring; options: the default direction, no
            hardness weighting, no gather_across_devices), or BatchAllTripletLoss,
            BatchHardTripletLoss, BatchSemiHardTripletLoss, st_ext's or upstream's (queued rows and
            labels become extra positives and negatives of the batch's anchors); or a subclass of one.
        memory_size: how many rows the queue keeps (the newest).
        mask_own_positive: ranking losses only: leave out of the step's candidates every queued row
            with the token ids of one of the batch's documents (a queued copy of a row's own positive
            would be a false negative), instead of counting it as a negative; and a copy of a row's
            positive elsewhere in the batch (a repeated row) is not that row's negative either.
        query_bank: ranking losses only, keyword-only: also queue the anchors, which become candidates
            in the wrapped loss's ``query_to_query`` and ``doc_to_query`` directions (it must score one
            of them; sentence-transformers releases without ``directions`` cannot).
        document_ids: ranking losses only, keyword-only: ``"label"`` or a function of the batch giving
            each row's document id (:mod:`st_ext.losses.same_document`); candidates of an anchor's own
            document, in the batch or queued, are not its negatives. Defaults to the wrapped loss's.

    With an empty queue the value and gradients are the wrapped loss's. The queue is updated only on
    training steps (gradients enabled); :meth:`memory_state` / :meth:`load_memory_state` save and
    restore it, which st_ext's trainer does with every checkpoint.
    """

    def __init__(
        self,
        model: nn.Module,
        loss: nn.Module,
        memory_size: int = DEFAULT_MEMORY_SIZE,
        *,
        mask_own_positive: bool = True,
        query_bank: bool = False,
        document_ids: DocumentIds | None = None,
    ):
        super().__init__()
        # Checked here: a zero or fractional size would otherwise surface as an empty slice.
        if isinstance(memory_size, bool) or not isinstance(memory_size, numbers.Integral) or memory_size <= 0:
            raise ValueError(
                f"memory_size must be a positive number of rows, got {memory_size!r}; e.g. memory_size=4096 keeps "
                "the embeddings of the last 4096 texts."
            )
        #: How the queue joins ``loss`` (:class:`RankingMemory` or :class:`TripletMemory`).
        self.joined = memory_for(loss)
        if loss_model(loss) is not model:
            raise ValueError(
                f"The wrapped {type(loss).__name__} was built for another model; build it with the model passed "
                "to CrossBatchMemoryLoss."
            )
        self.model = model
        self.loss = loss
        self.memory_size = int(memory_size)
        self.mask_own_positive = mask_own_positive
        check_document_ids(document_ids, type(self).__name__)
        wrapped_ids = getattr(loss, "document_ids", None)
        if document_ids is not None and wrapped_ids is not None and document_ids is not wrapped_ids:
            raise ValueError(
                "Give document_ids to CrossBatchMemoryLoss or to the loss it wraps, not different ones to both."
            )
        document_ids = wrapped_ids if document_ids is None else document_ids
        if (query_bank or document_ids is not None) and not isinstance(self.joined, RankingMemory):
            raise ValueError(
                f"query_bank and document_ids apply to ranking losses; {type(loss).__name__} takes labelled rows."
            )
        if query_bank:
            check_query_bank(loss)
        self.query_bank = query_bank
        #: Where each row's document id comes from (:mod:`st_ext.losses.same_document`); None: by token ids.
        self.document_ids = document_ids
        self.uses_gradient_cache = is_gradient_caching(loss)
        self.memory = MemoryBank()
        #: Queues of earlier layers' embeddings, by hidden-state index, for a layer-wise loss
        #: (:mod:`st_ext.losses.adaptive_layer`): each layer ranks against its own queue.
        self.layer_memory: dict[int, MemoryBank] = {}
        #: The query bank (earlier anchors, ``query_bank=True``), and a layer-wise loss's per layer.
        self.query_memory = MemoryBank()
        self.layer_query_memory: dict[int, MemoryBank] = {}

    def forward(self, sentence_features: Iterable[Features], labels: Tensor | None = None) -> Tensor:
        if self.uses_gradient_cache:
            return gradcache_forward(self.cached_loss(), sentence_features, labels)
        return self.joined.forward(self, list(sentence_features), labels)

    def cached_loss(self) -> CachedLoss:
        """This memory for the engine and for the wrappers around it. Only a memory around a cached ranking
        loss has one: a wrapper around any other would call it once per dimension or layer, and each
        call would enqueue its embeddings into the one queue."""
        return self.joined.cached_loss(self)

    def dropped_keys(self, batch_keys: Tensor) -> Tensor | None:
        """The keys whose queued rows a step with these documents leaves out (``mask_own_positive``)."""
        return batch_keys if self.mask_own_positive else None

    def bank(self, layer: int | None, *, queries: bool = False) -> MemoryBank:
        """The queue of ``layer`` (a hidden-state index), or of the model's output for None; with ``queries``,
        its query bank."""
        if queries:
            return self.query_memory if layer is None else self.layer_query_memory.get(layer, MemoryBank())
        return self.memory if layer is None else self.layer_memory.get(layer, MemoryBank())

    def push(
        self,
        layer: int | None,
        rows: Tensor,
        row_labels: Tensor,
        document_ids: Tensor | None = None,
        *,
        queries: bool = False,
    ) -> None:
        """Enqueue this step's rows (every rank's, under DDP) into ``layer``'s queue (or query bank)."""
        row_labels = row_labels.to(rows.device)
        if document_ids is not None:
            document_ids = gather_from_ranks(document_ids.to(rows.device))
        bank = enqueue(
            self.bank(layer, queries=queries),
            gather_from_ranks(rows),
            gather_from_ranks(row_labels),
            self.memory_size,
            document_ids,
        )
        memories = (self.query_memory, self.layer_query_memory) if queries else (self.memory, self.layer_memory)
        if layer is not None:
            memories[1][layer] = bank
        elif queries:
            self.query_memory = bank
        else:
            self.memory = bank

    # -- ranking steps ---------------------------------------------------------------------------

    def scores_itself(self, batch: BatchDocuments) -> bool:
        """Whether this step needs :func:`~st_ext.losses.masked_ranking.masked_ranking_loss`: the wrapped loss's
        scoring takes neither queued anchors, nor masks per anchor, nor a queue in other directions."""
        return (
            self.query_bank
            or self.document_ids is not None
            or ranking_directions(self.loss) not in (None, ("query_to_doc",))
            or (self.mask_own_positive and batch.repeats_a_positive())
        )

    def _batch_document_ids(self, batch: BatchDocuments, sentence_features: list[Features], labels) -> Tensor:
        return batch_document_ids(self.document_ids, sentence_features, labels, batch.rows).to(batch.keys.device)

    def _queued_kept(self, source: int | None, batch: BatchDocuments) -> tuple[Tensor | None, Tensor | None]:
        """Which rows of ``source``'s queue and query bank a step ranks against: by token ids, queued copies of
        the batch's documents (and, in the query bank, of its anchors' positives) are dropped for every anchor
        (``mask_own_positive``); by document ids the loss masks them per anchor instead. None: no such bank."""
        if self.document_ids is not None and source is not None:
            raise ValueError(
                "CrossBatchMemoryLoss with document_ids keeps no per-layer document ids: use it without "
                "AdaptiveLayerLoss/Matryoshka2dLoss, or without document_ids."
            )

        def kept(bank: MemoryBank, dropped: Tensor | None) -> Tensor:
            if not bank.rows or dropped is None:
                return torch.ones(bank.rows, dtype=torch.bool)
            return ~torch.isin(bank.labels, dropped.to(bank.labels.device)).cpu()

        by_ids = self.document_ids is not None
        documents = kept(self.bank(source), self.dropped_keys(batch.keys))
        if not self.query_bank:
            return documents, None
        dropped = None if by_ids or not self.mask_own_positive else batch.positive_keys
        return documents, kept(self.bank(source, queries=True), dropped)

    def queued_columns(self, source: int | None, anchors: Tensor, batch: BatchDocuments, training: bool) -> Reps:
        """The queued documents and the queued anchors this step ranks against, as two candidate columns (on the
        anchors' device and dtype; no rows outside training or without a query bank)."""
        nothing = anchors[:0].detach()
        if not training:
            return [[nothing], [nothing]]
        kept_documents, kept_queries = self._queued_kept(source, batch)

        def rows(bank: MemoryBank, kept: Tensor | None) -> Tensor:
            queued, _ = memory_like(bank, anchors)
            return nothing if queued is None or kept is None else queued[kept.to(queued.device)]

        return [[rows(self.bank(source), kept_documents)], [rows(self.bank(source, queries=True), kept_queries)]]

    def candidate_ids(
        self, batch: BatchDocuments, sentence_features: list[Features], labels, training: bool
    ) -> CandidateIds:
        """The document ids of the step's candidates: each row's (its document id, or by token ids its
        positive's key when ``mask_own_positive``; else none), each document column's, and the queued rows'
        in :meth:`queued_columns`' order (by token ids none: the copies are dropped)."""
        device = batch.keys.device
        columns = len(batch.keys) // max(batch.rows, 1)

        def unknown(count: int) -> Tensor:
            return torch.full((count,), NO_DOCUMENT, dtype=torch.int64, device=device)

        queued_documents, queued_queries = unknown(0), unknown(0)
        if training:
            kept_documents, kept_queries = self._queued_kept(None, batch)
            if self.document_ids is not None:
                if self.memory.rows:
                    queued_documents = self.memory.document_ids[kept_documents.to(self.memory.document_ids.device)].to(
                        device
                    )
                if kept_queries is not None and self.query_memory.rows:
                    queued_queries = self.query_memory.labels[kept_queries.to(self.query_memory.labels.device)].to(
                        device
                    )
            else:
                queued_documents = unknown(int(kept_documents.sum()))
                queued_queries = unknown(0 if kept_queries is None else int(kept_queries.sum()))
        if self.document_ids is not None:
            anchors = self._batch_document_ids(batch, sentence_features, labels)
            column_ids = [anchors] + [unknown(batch.rows)] * (columns - 1)
        elif self.mask_own_positive:
            anchors, column_ids = batch.positive_keys, list(batch.keys.split(batch.rows))
        else:
            anchors, column_ids = unknown(batch.rows), [unknown(batch.rows)] * columns
        return CandidateIds(anchors, column_ids, queued_documents, queued_queries)

    def enqueue_batch(
        self, source: int | None, reps: Reps, batch: BatchDocuments, sentence_features: list[Features], labels
    ) -> None:
        """Enqueue the step's documents (and anchors, with a query bank) into ``source``'s queues."""
        document_ids, anchor_labels = None, batch.positive_keys
        if self.document_ids is not None:
            anchor_labels = self._batch_document_ids(batch, sentence_features, labels)
            unknown = torch.full_like(anchor_labels, NO_DOCUMENT)
            document_ids = torch.cat([anchor_labels] + [unknown] * (len(reps) - 2))
        self.push(source, document_rows(reps), batch.keys, document_ids)
        if self.query_bank:
            self.push(source, torch.cat(reps[0]), anchor_labels, queries=True)

    @property
    def memory_embeddings(self) -> Tensor | None:
        """The queued embeddings, oldest first (no graph)."""
        return self.memory.embeddings

    @property
    def memory_labels(self) -> Tensor | None:
        """The queued class labels (triplet losses) or document keys (ranking losses), oldest first."""
        return self.memory.labels

    def reset_memory(self) -> None:
        self.memory = MemoryBank()
        self.layer_memory = {}
        self.query_memory = MemoryBank()
        self.layer_query_memory = {}

    def memory_state(self) -> dict[str, Any]:
        """The queues as CPU tensors, for ``torch.save``; :meth:`load_memory_state` restores them as they were."""

        def saved(bank: MemoryBank) -> dict[str, Tensor | None]:
            fields = {"embeddings": bank.embeddings, "labels": bank.labels}
            if bank.document_ids is not None:
                fields["document_ids"] = bank.document_ids
            return {name: None if value is None else value.detach().cpu().clone() for name, value in fields.items()}

        state = {"format": MEMORY_STATE_FORMAT, "memory_size": self.memory_size, **saved(self.memory)}
        if self.layer_memory:
            state["layers"] = {layer: saved(bank) for layer, bank in sorted(self.layer_memory.items())}
        if self.query_bank:
            state["queries"] = saved(self.query_memory)
            state["query_layers"] = {layer: saved(bank) for layer, bank in sorted(self.layer_query_memory.items())}
        return state

    def load_memory_state(self, state: dict[str, Any]) -> None:
        """Restore the queues saved by :meth:`memory_state` (the newest ``memory_size`` rows of each if they were
        larger). They move to the training device at the next step."""
        if not isinstance(state, dict) or state.get("format") != MEMORY_STATE_FORMAT:
            raise ValueError(
                f"Not a cross-batch memory state (format {MEMORY_STATE_FORMAT}); pass what memory_state() returned."
            )

        def restored(saved: dict[str, Any]) -> MemoryBank:
            embeddings, labels = saved["embeddings"], saved["labels"]
            if embeddings is None:
                return MemoryBank()
            if embeddings.ndim != 2 or labels is None or labels.shape != (len(embeddings),):
                raise ValueError(
                    "A saved cross-batch memory needs 2-D embeddings and one label per row; the file is damaged."
                )
            return enqueue(MemoryBank(), embeddings, labels, self.memory_size, saved.get("document_ids"))

        if self.query_bank and "queries" not in state:
            raise ValueError("This cross-batch memory keeps a query bank, and the saved state has none.")
        self.memory = restored(state)
        self.layer_memory = {int(layer): restored(saved) for layer, saved in state.get("layers", {}).items()}
        self.query_memory = restored(state["queries"]) if self.query_bank else MemoryBank()
        self.layer_query_memory = {
            int(layer): restored(saved) for layer, saved in state.get("query_layers", {}).items()
        }

    def get_config_dict(self) -> dict[str, Any]:
        return {
            "loss": type(self.loss).__name__,
            "memory_size": self.memory_size,
            "mask_own_positive": self.mask_own_positive,
            **({"query_bank": True} if self.query_bank else {}),
        }

    @property
    def citation(self) -> str:
        return XBM_CITATION + getattr(self.loss, "citation", "")


def with_memory(build_loss: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """A builder ``(model, memory_size=..., mask_own_positive=..., query_bank=..., **loss_kwargs)`` of
    ``build_loss(model, **loss_kwargs)`` wrapped in a CrossBatchMemoryLoss: the shape of a loss registry entry."""

    def build(
        model: nn.Module,
        memory_size: int = DEFAULT_MEMORY_SIZE,
        mask_own_positive: bool = True,
        query_bank: bool = False,
        **loss_kwargs: Any,
    ) -> CrossBatchMemoryLoss:
        return CrossBatchMemoryLoss(
            model,
            build_loss(model, **loss_kwargs),
            memory_size,
            mask_own_positive=mask_own_positive,
            query_bank=query_bank,
        )

    return build


# ---------------------------------------------------------------------------------------------
# Checkpoints


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
    if resume_from_checkpoint is True:
        resume_from_checkpoint = get_last_checkpoint(trainer.args.output_dir)
        if resume_from_checkpoint is None:
            return []  # the trainer raises its own error about the missing checkpoint
    return load_memories(trainer.loss, resume_from_checkpoint, allow_empty=allow_empty)
