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
    is_gradient_caching,
    loss_model,
    ranking_loss_from_embeddings,
    st_losses,
    upstream_loss_class,
)
from st_ext.losses.cached_loss import CachedLoss, LossStep, with_loss
from st_ext.losses.cached_ranking import CachedMultipleNegativesSymmetricRankingLoss
from st_ext.losses.gradcache import Features, Reps, batch_size_of, gradcache_forward, row_keys
from st_ext.losses.loss_descriptions import as_cached_loss
from st_ext.losses.triplet import check_triplet_labels, triplet_loss_from_embeddings, triplet_settings

logger = logging.getLogger(__name__)

MEMORY_FILENAME = "cross_batch_memory.pt"
DEFAULT_MEMORY_SIZE = 1024
MEMORY_STATE_FORMAT = 1
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


# ---------------------------------------------------------------------------------------------
# The queue


@dataclass(frozen=True)
class MemoryBank:
    """The queue: rows oldest first, never part of a graph. ``labels`` are class labels (triplet losses)
    or document keys (ranking losses, :func:`document_keys`).

    Updates build a new bank rather than write into this one: the graph of the step that read it may
    still need its tensors for the backward pass.
    """

    embeddings: Tensor | None = None
    labels: Tensor | None = None

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


def enqueue(bank: MemoryBank, embeddings: Tensor, labels: Tensor, memory_size: int) -> MemoryBank:
    """A new bank: the old rows followed by these (detached, in the bank's dtype, on their own device),
    keeping the newest ``memory_size``."""
    embeddings, labels = embeddings.detach(), labels.detach()
    if len(labels) != len(embeddings):
        raise ValueError(f"{len(embeddings)} embeddings to enqueue but {len(labels)} labels.")
    if bank.rows:
        check_fits(bank.embeddings, embeddings)
        embeddings = embeddings.to(bank.embeddings.dtype)
        labels = labels.to(bank.labels.dtype)
        old_embeddings = bank.embeddings.to(embeddings.device)
        old_labels = bank.labels.to(labels.device)
    else:
        old_embeddings, old_labels = embeddings[:0], labels[:0]
    keep_new = min(len(embeddings), memory_size)
    keep_old = min(len(old_embeddings), memory_size - keep_new)
    return MemoryBank(
        torch.cat([old_embeddings[len(old_embeddings) - keep_old :], embeddings[len(embeddings) - keep_new :]]),
        torch.cat([old_labels[len(old_labels) - keep_old :], labels[len(labels) - keep_new :]]),
    )


def gather_from_ranks(tensor: Tensor) -> Tensor:
    """Every rank's rows, in rank order, on every rank (detached); ``tensor`` itself when not distributed.

    Ranks may hold different numbers of rows (a last, shorter batch): sizes go first, and rows travel
    padded to the largest.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensor
    tensor = tensor.detach().contiguous()
    world_size = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.int64, device=tensor.device) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor([len(tensor)], dtype=torch.int64, device=tensor.device))
    sizes = [int(size) for size in sizes]
    padded = tensor.new_zeros((max(sizes), *tensor.shape[1:]))
    padded[: len(tensor)] = tensor
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(parts, padded)
    return torch.cat([part[:size] for part, size in zip(parts, sizes)])


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
    directions = tuple(getattr(loss, "directions", ("query_to_doc",)))
    if directions != ("query_to_doc",):
        raise ValueError(
            f"CrossBatchMemoryLoss ranks queries against queued documents only, so it needs directions=('query_to_doc',) "
            f"(got {directions}): leave directions at its default."
        )
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


class RankingMemory:
    """A queue of documents for a ranking loss (MultipleNegativesRankingLoss, its cached forms and their
    subclasses): handed to the wrapped loss's own scoring as one more column of candidates, so every
    option it has runs as it does without a memory."""

    def __init__(self, loss: nn.Module) -> None:
        check_ranking_options(loss)
        self.loss = loss

    def forward(
        self, memory: CrossBatchMemoryLoss, sentence_features: list[Features], labels: Tensor | None
    ) -> Tensor:
        """A step of a loss that embeds the batch in one pass (MultipleNegativesRankingLoss)."""
        keys = ranking_keys(self.loss, sentence_features)
        training = torch.is_grad_enabled()
        embeddings = [memory.model(features)["sentence_embedding"] for features in sentence_features]
        added = queued_candidates(memory.bank(None), embeddings[0], memory.dropped_keys(keys)) if training else []
        value = ranking_loss_from_embeddings(self.loss, embeddings + [torch.cat(column) for column in added], labels)
        if training:
            memory.push(None, torch.cat(embeddings[1:]), keys)
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
    holds up to ``memory_size`` rows: (sampled layers + 1) × ``memory_size`` embeddings in all."""

    def queued(step: LossStep, sentence_features: list[Features], ranges, mini_batch_size: int) -> LossStep:
        keys = ranking_keys(memory.loss, sentence_features)
        training = torch.is_grad_enabled()

        def candidates(sources: list, outputs: list[Reps]) -> list[Reps]:
            added = step.candidates(sources, outputs)
            if not training:
                return added
            return [
                columns + queued_candidates(memory.bank(source), torch.cat(reps[0]), memory.dropped_keys(keys))
                for columns, source, reps in zip(added, sources, outputs)
            ]

        def finish(sources: list, outputs: list[Reps]) -> None:
            step.finish(sources, outputs)
            if not training:
                return
            if sources != [None]:
                _check_same_layers_on_every_rank(sources)
            for source, reps in zip(sources, outputs):
                memory.push(source, document_rows(reps), keys)

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
            would be a false negative), instead of counting it as a negative.

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
        self.uses_gradient_cache = is_gradient_caching(loss)
        self.memory = MemoryBank()
        #: Queues of earlier layers' embeddings, by hidden-state index, for a layer-wise loss
        #: (:mod:`st_ext.losses.adaptive_layer`): each layer ranks against its own queue.
        self.layer_memory: dict[int, MemoryBank] = {}

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

    def bank(self, layer: int | None) -> MemoryBank:
        """The queue of ``layer`` (a hidden-state index), or of the model's output for None."""
        return self.memory if layer is None else self.layer_memory.get(layer, MemoryBank())

    def push(self, layer: int | None, rows: Tensor, row_labels: Tensor) -> None:
        """Enqueue this step's rows (every rank's, under DDP) into ``layer``'s queue."""
        row_labels = row_labels.to(rows.device)
        bank = enqueue(self.bank(layer), gather_from_ranks(rows), gather_from_ranks(row_labels), self.memory_size)
        if layer is None:
            self.memory = bank
        else:
            self.layer_memory[layer] = bank

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

    def memory_state(self) -> dict[str, Any]:
        """The queues as CPU tensors, for ``torch.save``; :meth:`load_memory_state` restores them as they were."""

        def saved(bank: MemoryBank) -> dict[str, Tensor | None]:
            return {
                "embeddings": None if bank.embeddings is None else bank.embeddings.detach().cpu().clone(),
                "labels": None if bank.labels is None else bank.labels.detach().cpu().clone(),
            }

        state = {"format": MEMORY_STATE_FORMAT, "memory_size": self.memory_size, **saved(self.memory)}
        if self.layer_memory:
            state["layers"] = {layer: saved(bank) for layer, bank in sorted(self.layer_memory.items())}
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
            return enqueue(MemoryBank(), embeddings, labels, self.memory_size)

        self.memory = restored(state)
        self.layer_memory = {int(layer): restored(saved) for layer, saved in state.get("layers", {}).items()}

    def get_config_dict(self) -> dict[str, Any]:
        return {
            "loss": type(self.loss).__name__,
            "memory_size": self.memory_size,
            "mask_own_positive": self.mask_own_positive,
        }

    @property
    def citation(self) -> str:
        return XBM_CITATION + getattr(self.loss, "citation", "")


def with_memory(build_loss: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """A builder ``(model, memory_size=..., mask_own_positive=..., **loss_kwargs)`` of ``build_loss(model,
    **loss_kwargs)`` wrapped in a CrossBatchMemoryLoss: the shape of a loss registry entry."""

    def build(
        model: nn.Module, memory_size: int = DEFAULT_MEMORY_SIZE, mask_own_positive: bool = True, **loss_kwargs: Any
    ) -> CrossBatchMemoryLoss:
        return CrossBatchMemoryLoss(
            model, build_loss(model, **loss_kwargs), memory_size, mask_own_positive=mask_own_positive
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
