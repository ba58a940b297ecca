"""Cross-batch memory (XBM, https://huggingface.co/papers/1912.06798) for sentence-transformers losses.

A FIFO queue of detached embeddings from earlier training steps joins every step's loss: for
(Cached)MultipleNegativesRankingLoss the queued documents are more candidates (:mod:`.ranking_memory`); for
the triplet losses the queued rows and their labels extend the batch's references (:mod:`.triplet_memory`).
Which of the two, and how a step is scored, is decided when the memory is built, never by a batch.
The step's rows are enqueued after the loss (queued first, the batch's own positives would come back
as negatives), detached and, under DDP, gathered from every rank. Gradients reach the batch only, and
a cached loss stays exact: the queue is a constant in its loss over embeddings (GradCache's step 2),
and the replay (step 3) never looks at it.

Every memory runs on st_ext's engine (:func:`~st_ext.losses.gradcache.gradcache_forward`): around a cached
loss with its mini-batch settings, around any other in one pass over the whole batch (the plain forward and
backward). The queue joins each step as data (a :class:`~st_ext.losses.loss_functions.BatchJoin`), so a wrapper
around the memory (Matryoshka, the layer-wise losses) truncates it with the batch and gives each layer its own.

Ranking losses queue documents (the positive and hard-negative columns), not anchors: they are what
anchors are ranked against, and queries may be embedded differently (prompts, asymmetric models). A
queued copy of an anchor's own positive (the same text again, in a later epoch or for another query)
would be a false negative with a near-perfect score; ``mask_own_positive`` leaves every queued copy of
any of the batch's documents out of the step's candidates, and a copy of a row's positive elsewhere in the
batch out of that row's, recognising rows by a hash of their non-padding token ids, stored in place of a
label. Queued embeddings come from older parameters: XBM finds they drift slowly enough, so size the
queue in steps (``memory_size`` ≈ documents per step × a few hundred steps).

With ``query_bank=True`` the anchors are queued too (ContAccum), candidates in the wrapped loss's
``query_to_query`` and ``doc_to_query`` directions; with ``document_ids`` every candidate of an anchor's
own document is masked for it (:mod:`st_ext.losses.same_document`; ``"text"``: every copy of a row's
texts, in the batch or queued).

The queue is read and written only when gradients are enabled (training steps); evaluation computes
the plain loss. st_ext's trainer saves it in every checkpoint and restores it on resume (a checkpoint
without it is an error); with an upstream trainer, :class:`~st_ext.training.memory_checkpoints.CrossBatchMemoryCallback`
saves it.
"""

from __future__ import annotations

import numbers
import sys
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from st_ext._compat import is_gradient_caching, loss_model, st_losses, upstream_loss_class
from st_ext.losses.cached_ranking import CachedMultipleNegativesSymmetricRankingLoss
from st_ext.losses.features import Features, Ranges
from st_ext.losses.gathering import gather_from_ranks
from st_ext.losses.gradcache import CachedLoss, LossStep, described, gradcache_forward
from st_ext.losses.loss_descriptions import as_cached_loss
from st_ext.losses.loss_functions import Source
from st_ext.losses.memory_bank import MemoryBank, enqueue
from st_ext.losses.ranking_memory import check_ranking_options, ranking_step
from st_ext.losses.same_document import TEXT, DocumentIds, check_document_ids, key_width
from st_ext.losses.triplet import triplet_settings
from st_ext.losses.triplet_memory import triplet_step

DEFAULT_MEMORY_SIZE = 1024
#: 2: document ids as keys, ``(rows, width)``, a query bank's too; 1 (still read): one id per row, a query
#: bank's in place of its labels.
MEMORY_STATE_FORMAT = 2
READABLE_STATE_FORMATS = (1, 2)
#: A memory around an uncached loss embeds the whole batch in one pass: no mini-batch is smaller.
WHOLE_BATCH = sys.maxsize
#: Upstream's ranking losses that also rank documents against queries, which a memory of documents cannot.
SYMMETRIC_RANKING_LOSSES = ("MultipleNegativesSymmetricRankingLoss", "CachedMultipleNegativesSymmetricRankingLoss")

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


def joins_ranking(loss: nn.Module) -> bool:
    """Whether the queue joins ``loss`` as candidates (a ranking loss) rather than as references (a triplet
    loss), or an error naming the losses a memory supports."""
    upstream = st_losses()
    symmetric = tuple(filter(None, map(upstream_loss_class, SYMMETRIC_RANKING_LOSSES))) + (
        CachedMultipleNegativesSymmetricRankingLoss,
    )
    if isinstance(loss, symmetric):
        raise TypeError(
            f"CrossBatchMemoryLoss cannot wrap {type(loss).__name__}: Symmetric variants rank queries against "
            "documents and back, and the memory holds no queries. Use (Cached)MultipleNegativesRankingLoss."
        )
    if isinstance(loss, (upstream.MultipleNegativesRankingLoss, upstream.CachedMultipleNegativesRankingLoss)):
        return True
    if triplet_settings(loss) is not None:
        return False
    raise TypeError(
        f"CrossBatchMemoryLoss cannot wrap {type(loss).__name__}. Supported: MultipleNegativesRankingLoss, "
        "CachedMultipleNegativesRankingLoss (queued documents become extra negatives), BatchAllTripletLoss, "
        "BatchHardTripletLoss, BatchSemiHardTripletLoss (queued rows become extra references), and their "
        "subclasses. Symmetric variants are not supported: the memory holds no queries."
    )


class CrossBatchMemoryLoss(nn.Module):
    """A loss that also sees the embeddings of the last ``memory_size`` rows from earlier steps.

    Args:
        model: the SentenceTransformer being trained (the one ``loss`` was built with).
        loss: MultipleNegativesRankingLoss or CachedMultipleNegativesRankingLoss (queued documents
            become extra candidates, scored with the loss's ``scale``, ``similarity_fct``, ``directions``
            and ``partition_mode`` by st_ext's ranking scoring; no hardness weighting, no
            gather_across_devices, no subclass overriding the scoring), or BatchAllTripletLoss,
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
            each row's document id, or ``"text"``: rows with an identical text are one document
            (:mod:`st_ext.losses.same_document`); candidates of an anchor's own document, in the batch or
            queued, are not its negatives. Defaults to the wrapped loss's.

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
        #: How the queue joins ``loss``: as candidates of a ranking loss, or as references of a triplet loss.
        self.joins_ranking: bool = joins_ranking(loss)
        if loss_model(loss) is not model:
            raise ValueError(
                f"The wrapped {type(loss).__name__} was built for another model; build it with the model passed "
                "to CrossBatchMemoryLoss."
            )
        self.model: nn.Module = model
        self.loss: nn.Module = loss
        self.memory_size: int = int(memory_size)
        self.mask_own_positive: bool = mask_own_positive
        check_document_ids(document_ids, type(self).__name__)
        wrapped_ids = getattr(loss, "document_ids", None)
        if document_ids is not None and wrapped_ids is not None and document_ids != wrapped_ids:
            raise ValueError(
                "Give document_ids to CrossBatchMemoryLoss or to the loss it wraps, not different ones to both."
            )
        document_ids = wrapped_ids if document_ids is None else document_ids
        if (query_bank or document_ids is not None) and not self.joins_ranking:
            raise ValueError(
                f"query_bank and document_ids apply to ranking losses; {type(loss).__name__} takes labelled rows."
            )
        if document_ids == TEXT and not mask_own_positive:
            raise ValueError(
                'document_ids="text" masks every copy of a row\'s texts, queued ones included, which '
                "mask_own_positive=False asks to keep as negatives: drop one of the two."
            )
        if self.joins_ranking:
            check_ranking_options(loss, query_bank)
        self.uses_gradient_cache: bool = is_gradient_caching(loss)
        if self.uses_gradient_cache and as_cached_loss(loss) is None:
            raise TypeError(
                f"CrossBatchMemoryLoss cannot wrap {type(loss).__name__}: it overrides a step of upstream's cached "
                "engine, which only upstream's forward calls, and the memory runs st_ext's. Drop the override."
            )
        self.query_bank: bool = query_bank
        #: Where each row's document id comes from (:mod:`st_ext.losses.same_document`); None: by token ids.
        self.document_ids: DocumentIds | None = document_ids
        self.memory: MemoryBank = MemoryBank()
        #: Queues of earlier layers' embeddings, by hidden-state index, for a layer-wise loss
        #: (:mod:`st_ext.losses.adaptive_layer`): each layer ranks against its own queue.
        self.layer_memory: dict[int, MemoryBank] = {}
        #: The query bank (earlier anchors, ``query_bank=True``), and a layer-wise loss's per layer.
        self.query_memory: MemoryBank = MemoryBank()
        self.layer_query_memory: dict[int, MemoryBank] = {}

    def forward(
        self, sentence_features: Iterable[Features], labels: Tensor | None = None
    ) -> Tensor | dict[str, Tensor]:
        return gradcache_forward(self.cached_loss(), sentence_features, labels)

    def cached_loss(self) -> CachedLoss:
        """This memory for the engine and for the wrappers around it: a cached loss's mini-batch settings, or
        one pass over the whole batch."""
        if self.uses_gradient_cache:
            return replace(described(self.loss, self.start_step), name=type(self).__name__)
        return CachedLoss(type(self).__name__, self.model, self.start_step, WHOLE_BATCH)

    def start_step(self, sentence_features: list[Features], ranges: list[Ranges], mini_batch_size: int) -> LossStep:
        """One step: the queue joined to the batch, scored by the scoring chosen at construction."""
        if self.joins_ranking:
            return ranking_step(self, sentence_features, mini_batch_size)
        return triplet_step(self, sentence_features)

    def bank(self, source: Source, *, queries: bool = False) -> MemoryBank:
        """The queue of ``source`` (a hidden-state index), or of the model's output for None; with ``queries``,
        its query bank."""
        if queries:
            return self.query_memory if source is None else self.layer_query_memory.get(source, MemoryBank())
        return self.memory if source is None else self.layer_memory.get(source, MemoryBank())

    def push(
        self,
        source: Source,
        rows: Tensor,
        row_labels: Tensor,
        document_ids: Tensor | None = None,
        *,
        queries: bool = False,
    ) -> None:
        """Enqueue this step's rows (every rank's, under DDP) into ``source``'s queue (or query bank)."""
        row_labels = row_labels.to(rows.device)
        if document_ids is not None:
            document_ids = gather_from_ranks(document_ids.to(rows.device))
        bank = enqueue(
            self.bank(source, queries=queries),
            gather_from_ranks(rows),
            gather_from_ranks(row_labels),
            self.memory_size,
            document_ids,
        )
        if source is not None:
            (self.layer_query_memory if queries else self.layer_memory)[source] = bank
        elif queries:
            self.query_memory = bank
        else:
            self.memory = bank

    @staticmethod
    def check_same_sources_on_every_rank(sources: list[Source]) -> None:
        """Ranks that drew different layers (Python's ``random`` seeded differently) would mix layers in one
        queue without any shape error."""
        if sources == [None] or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        drawn: list = [None] * dist.get_world_size()
        dist.all_gather_object(drawn, sources)
        if any(other != sources for other in drawn):
            raise RuntimeError(
                f"The ranks sampled different layers ({drawn}): each layer's cross-batch memory would mix them. Seed "
                "Python's random module alike on every rank (the Trainer's seed does), or set n_layers_per_step=-1."
            )

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

        state: dict[str, Any] = {"format": MEMORY_STATE_FORMAT, "memory_size": self.memory_size, **saved(self.memory)}
        if self.layer_memory:
            state["layers"] = {layer: saved(bank) for layer, bank in sorted(self.layer_memory.items())}
        if self.query_bank:
            state["queries"] = saved(self.query_memory)
            state["query_layers"] = {layer: saved(bank) for layer, bank in sorted(self.layer_query_memory.items())}
        return state

    def load_memory_state(self, state: dict[str, Any]) -> None:
        """Restore the queues saved by :meth:`memory_state` (the newest ``memory_size`` rows of each if they were
        larger). They move to the training device at the next step."""
        if not isinstance(state, dict) or state.get("format") not in READABLE_STATE_FORMATS:
            raise ValueError(
                f"Not a cross-batch memory state (format {MEMORY_STATE_FORMAT}); pass what memory_state() returned."
            )
        width = None if self.document_ids is None else key_width(self.document_ids)

        def restored(saved: dict[str, Any], *, queries: bool = False) -> MemoryBank:
            embeddings, labels = saved["embeddings"], saved["labels"]
            if embeddings is None:
                return MemoryBank()
            if embeddings.ndim != 2 or labels is None or labels.shape != (len(embeddings),):
                raise ValueError(
                    "A saved cross-batch memory needs 2-D embeddings and one label per row; the file is damaged."
                )
            document_ids = saved.get("document_ids")
            if state["format"] == 1 and queries and width is not None:
                document_ids = labels
            if document_ids is not None and document_ids.ndim == 1:
                document_ids = document_ids.unsqueeze(1)
            saved_width = None if document_ids is None else document_ids.shape[1]
            if saved_width != width:
                raise ValueError(
                    f"The saved cross-batch memory holds {saved_width or 'no'} document key(s) per row and this one, "
                    f"with document_ids={self.document_ids!r}, {width or 'none'}: resume with the document_ids of "
                    "the run that saved it, or start the memory empty."
                )
            return enqueue(MemoryBank(), embeddings, labels, self.memory_size, document_ids)

        if self.query_bank and "queries" not in state:
            raise ValueError("This cross-batch memory keeps a query bank, and the saved state has none.")
        self.memory = restored(state)
        self.layer_memory = {int(layer): restored(saved) for layer, saved in state.get("layers", {}).items()}
        self.query_memory = restored(state["queries"], queries=True) if self.query_bank else MemoryBank()
        self.layer_query_memory = {
            int(layer): restored(saved, queries=True) for layer, saved in state.get("query_layers", {}).items()
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
