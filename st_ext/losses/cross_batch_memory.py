"""Cross-batch memory (XBM, https://huggingface.co/papers/1912.06798) for sentence-transformers losses.

A FIFO queue of detached embeddings from earlier training steps joins every step's loss: for
(Cached)MultipleNegativesRankingLoss the queued documents are extra candidates in every anchor's
softmax; for the triplet losses the queued rows and their labels extend the batch's references.
The step's rows are enqueued after the loss (queued first, the batch's own positives would come back
as negatives), detached and, under DDP, gathered from every rank. Gradients reach the batch only, and
a cached loss stays exact: the queue is a constant in its loss over embeddings (GradCache's step 2),
and the replay (step 3) never looks at it.

Ranking losses queue documents (the positive and hard-negative columns), not anchors: they are what
anchors are ranked against, and queries may be embedded differently (prompts, asymmetric models). A
queued copy of an anchor's own positive (the same text again, in a later epoch or for another query)
would be a false negative with a near-perfect score; ``mask_own_positive`` leaves it out of that
anchor's softmax, recognising rows by a hash of their non-padding token ids, stored in place of a
label. Queued embeddings come from older parameters: XBM finds they drift slowly enough, so size the
queue in steps (``memory_size`` ≈ documents per step × a few hundred steps).

The queue is read and written only when gradients are enabled (training steps); evaluation computes
the plain loss. st_ext's trainer saves it in every checkpoint and restores it on resume (a checkpoint
without it is an error); with an upstream trainer, :class:`CrossBatchMemoryCallback` saves it.
"""

from __future__ import annotations

import hashlib
import logging
import math
import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from st_ext._compat import is_gradient_caching, loss_model, st_losses
from st_ext.losses.cached_loss import CachedLoss, LossFn, LossStep, as_cached_loss, register_cached_loss, with_loss
from st_ext.losses.cached_ranking import CachedMultipleNegativesRankingLoss
from st_ext.losses.gradcache import Features, Reps, batch_size_of, chunked_rows, gradcache_forward, row_keys
from st_ext.losses.triplet import check_triplet_labels, triplet_loss_from_embeddings, triplet_settings

logger = logging.getLogger(__name__)

MEMORY_FILENAME = "cross_batch_memory.pt"
DEFAULT_MEMORY_SIZE = 1024
MEMORY_STATE_FORMAT = 1

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


def memory_like(
    bank: MemoryBank, embeddings: Tensor, embedding_map: Callable[[Tensor], Tensor] | None = None
) -> tuple[Tensor | None, Tensor | None]:
    """The queue (through a wrapper's ``embedding_map``, if any) on the batch's device and in its dtype,
    or (None, None) when it is empty."""
    if not bank.rows:
        return None, None
    queued = bank.embeddings if embedding_map is None else embedding_map(bank.embeddings)
    check_fits(queued, embeddings)
    return queued.to(device=embeddings.device, dtype=embeddings.dtype), bank.labels.to(device=embeddings.device)


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
    """Refuse the MNRL options whose meaning a queue of documents cannot carry."""
    directions = tuple(getattr(loss, "directions", ("query_to_doc",)))
    if directions != ("query_to_doc",):
        raise ValueError(
            f"CrossBatchMemoryLoss supports MNRL with directions=('query_to_doc',) only, got {directions}: the "
            "memory holds documents without their queries, so the other directions have nothing to rank."
        )
    if getattr(loss, "hardness_mode", None) is not None and getattr(loss, "hardness_strength", 0.0) > 0:
        raise ValueError(
            "CrossBatchMemoryLoss does not support hardness_mode/hardness_strength on the wrapped MNRL; "
            "leave them at their defaults."
        )
    if getattr(loss, "gather_across_devices", False):
        raise ValueError(
            "CrossBatchMemoryLoss does not support gather_across_devices=True on the wrapped MNRL: under DDP the "
            "memory already holds every rank's documents from earlier steps. Set gather_across_devices=False."
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


def ranking_loss_fn(
    loss: nn.Module, bank: MemoryBank, keys: Tensor | None, chunk_size: int, show_progress_bar: bool
) -> LossFn:
    """MNRL's cross-entropy (``loss``'s scale and similarity) with candidates = the batch's documents
    followed by ``bank``'s, as a :data:`~st_ext.losses.cached_loss.LossFn`.

    Anchor rows go ``chunk_size`` at a time; with ``with_backward`` each chunk back-propagates into
    ``reps`` at once (GradCache's step 2) and the value comes back detached. ``keys`` are the documents'
    (the positives' first, one per anchor), or None: a queued row with the key of an anchor's own
    positive is left out of that anchor's softmax. A wrapper's ``embedding_map`` (Matryoshka's
    truncation and re-normalisation) applies to the queue as to the batch.
    """

    def loss_fn(
        reps: Reps, frozen: Reps | None, labels: Tensor | None, *, with_backward: bool, embedding_map=None
    ) -> Tensor:
        anchors, documents = torch.cat(reps[0]), document_rows(reps)
        memory_embeddings, memory_keys = memory_like(bank, anchors, embedding_map)
        candidates = documents if memory_embeddings is None else torch.cat([documents, memory_embeddings])
        batch_size = len(anchors)
        targets = torch.arange(batch_size, device=anchors.device)
        anchor_keys = None if keys is None or memory_keys is None else keys.to(anchors.device)
        chunk_losses = []
        for begin, end in tqdm(
            list(chunked_rows(batch_size, chunk_size)), desc="Calculating loss", disable=not show_progress_bar
        ):
            scores = loss.similarity_fct(anchors[begin:end], candidates) * loss.scale
            if anchor_keys is not None:
                own_positive = torch.zeros_like(scores, dtype=torch.bool)
                own_positive[:, len(documents) :] = anchor_keys[begin:end, None] == memory_keys[None]
                scores = scores.masked_fill(own_positive, -math.inf)
            chunk_loss = F.cross_entropy(scores, targets[begin:end]) * (end - begin) / batch_size
            if with_backward:
                chunk_loss.backward()
                chunk_loss = chunk_loss.detach()
            chunk_losses.append(chunk_loss)
        return sum(chunk_losses)

    return loss_fn


def with_queue(memory: CrossBatchMemoryLoss, description: CachedLoss) -> CachedLoss:
    """The cached ranking loss ``description`` with ``memory``'s queues: each call of its loss over
    embeddings ranks against the queue of its layer (the model's output, or a layer a layer-wise loss
    draws), and once the step's loss is computed each layer's documents join that layer's queue. The
    documents enqueued are step (1)'s embeddings: with the RNG replayed they are the ones the gradients
    were computed for.

    Each layer has its own queue: one for all layers would put final-layer embeddings among an earlier
    layer's candidates, another embedding space. A layer's queue grows only on steps that sample it (with
    ``n_layers_per_step=1`` of L layers, about L times more slowly, so its rows are older), and every queue
    holds up to ``memory_size`` rows: (sampled layers + 1) × ``memory_size`` embeddings in all."""

    def queued(step: LossStep, sentence_features: list[Features], mini_batch_size: int) -> LossStep:
        keys = ranking_keys(memory.loss, sentence_features)
        training = torch.is_grad_enabled()

        def draw(layer: int | None) -> LossFn:
            bank = memory.bank(layer) if training else MemoryBank()
            masked = keys if memory.mask_own_positive else None
            return ranking_loss_fn(memory.loss, bank, masked, mini_batch_size, description.show_progress_bar)

        def finish(layers: list, outputs: list[Reps]) -> None:
            if not training:
                return
            if layers != [None]:
                _check_same_layers_on_every_rank(layers)
            for layer, reps in zip(layers, outputs):
                memory.push(layer, document_rows(reps), keys)

        return replace(step, draw=draw, finish=finish)

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


def triplet_step(
    loss: nn.Module, model: nn.Module, sentence_features: list[Features], labels: Tensor | None, bank: MemoryBank
) -> tuple[Tensor, Tensor, Tensor]:
    """(loss value, embeddings to enqueue, their labels) for a triplet loss with the queue."""
    loss_function, distance_metric, margin = triplet_settings(loss)
    if len(sentence_features) != 1:
        raise ValueError(
            f"{type(loss).__name__} takes one text column and a label column, got {len(sentence_features)} text columns."
        )
    embeddings = model(sentence_features[0])["sentence_embedding"]
    labels = check_triplet_labels(labels, len(embeddings), f"CrossBatchMemoryLoss around {type(loss).__name__}")
    memory_embeddings, memory_labels = memory_like(bank, embeddings)
    value = triplet_loss_from_embeddings(
        loss_function, distance_metric, margin, embeddings, labels, memory_embeddings, memory_labels
    )
    return value, embeddings, labels


def memory_kind(loss: nn.Module) -> str:
    """ "ranking" or "triplet", or an error naming the losses a memory supports."""
    upstream = st_losses()
    ranking = (
        upstream.MultipleNegativesRankingLoss,
        upstream.CachedMultipleNegativesRankingLoss,
        CachedMultipleNegativesRankingLoss,
    )
    if type(loss) in ranking:
        check_ranking_options(loss)
        return "ranking"
    if triplet_settings(loss) is not None:
        return "triplet"
    raise TypeError(
        f"CrossBatchMemoryLoss cannot wrap {type(loss).__name__}. Supported: MultipleNegativesRankingLoss, "
        "CachedMultipleNegativesRankingLoss (queued documents become extra negatives), BatchAllTripletLoss, "
        "BatchHardTripletLoss, BatchSemiHardTripletLoss (queued rows become extra references). Symmetric variants "
        "are not supported: the memory holds no queries."
    )


# ---------------------------------------------------------------------------------------------
# The loss


class CrossBatchMemoryLoss(nn.Module):
    """A loss that also sees the embeddings of the last ``memory_size`` rows from earlier steps.

    Args:
        model: the SentenceTransformer being trained (the one ``loss`` was built with).
        loss: MultipleNegativesRankingLoss or CachedMultipleNegativesRankingLoss (queued documents
            become extra negatives; options: the default direction, no hardness weighting, no
            gather_across_devices), or BatchAllTripletLoss, BatchHardTripletLoss,
            BatchSemiHardTripletLoss, st_ext's or upstream's (queued rows and labels become extra
            positives and negatives of the batch's anchors).
        memory_size: how many rows the queue keeps (the newest).
        mask_own_positive: ranking losses only: leave a queued copy of an anchor's own positive
            (same token ids) out of its softmax instead of counting it as a negative.

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
        self.kind = memory_kind(loss)
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
        sentence_features = list(sentence_features)
        if self.kind == "ranking" and self.uses_gradient_cache:
            return gradcache_forward(self.cached_loss(), sentence_features, labels)
        training = torch.is_grad_enabled()
        bank = self.memory if training else MemoryBank()
        if self.kind == "ranking":
            keys = ranking_keys(self.loss, sentence_features)
            embeddings = [self.model(features)["sentence_embedding"] for features in sentence_features]
            masked = keys if self.mask_own_positive else None
            loss_fn = ranking_loss_fn(self.loss, bank, masked, len(embeddings[0]), show_progress_bar=False)
            value = loss_fn([[embedding] for embedding in embeddings], None, None, with_backward=False)
            rows, row_labels = torch.cat(embeddings[1:]), keys
        else:
            value, rows, row_labels = triplet_step(self.loss, self.model, sentence_features, labels, bank)
        if training:
            self.push(None, rows, row_labels)
        return value

    def cached_loss(self) -> CachedLoss:
        """This memory for the engine and for the wrappers around it. Only a memory around a cached ranking
        loss has one: a wrapper around any other would call it once per dimension or layer, and each
        call would enqueue its embeddings into the one queue."""
        if self.kind == "ranking" and self.uses_gradient_cache:
            inner = as_cached_loss(self.loss)
            if inner is None:
                raise TypeError(
                    f"{type(self.loss).__name__} has no cached-loss description; see st_ext.losses.cached_loss."
                )
            return with_queue(self, inner)
        raise TypeError(
            f"Wrappers take a CrossBatchMemoryLoss over CachedMultipleNegativesRankingLoss only (st_ext then gives "
            f"each layer its own queue and truncates the queue with the batch), not over {type(self.loss).__name__}: "
            "called once per dimension or layer, the memory would mix their embeddings in one queue. For "
            "MultipleNegativesRankingLoss use CachedMultipleNegativesRankingLoss; with mini_batch_size at least "
            "the batch size it runs in one pass."
        )

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


register_cached_loss(CrossBatchMemoryLoss, lambda loss: loss.cached_loss())
