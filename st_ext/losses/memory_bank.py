"""A cross-batch memory's queue: rows of earlier steps, oldest first, never part of a graph.

Rows are recognised by a hash of their non-padding token ids (:func:`document_keys`), so that the same text
gets the same key in any batch, whatever its padding: a ranking memory leaves queued copies of a batch's
own documents out of its candidates by them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

from st_ext.losses.features import Features, batch_size_of, row_keys


@dataclass(frozen=True)
class MemoryBank:
    """The queue: rows oldest first, never part of a graph. ``labels`` are class labels (triplet losses)
    or document keys (ranking losses, :func:`document_keys`); ``document_ids``, where the loss masks by
    document, the document keys of each row, ``(rows, width)`` (:mod:`st_ext.losses.same_document`).

    Updates build a new bank rather than write into this one: the graph of the step that read it may
    still need its tensors for the backward pass.
    """

    embeddings: Tensor | None = None
    labels: Tensor | None = None
    document_ids: Tensor | None = None

    @property
    def rows(self) -> int:
        return 0 if self.embeddings is None else len(self.embeddings)

    def queued(self) -> tuple[Tensor, Tensor] | None:
        """The rows' ``(embeddings, labels)``; None when the bank is empty."""
        if self.embeddings is None or self.labels is None or not len(self.embeddings):
            return None
        return self.embeddings, self.labels

    def without(self, keys: Tensor | None) -> MemoryBank:
        """This bank less its rows labelled with one of ``keys`` (None: all of them kept)."""
        queued = self.queued()
        if keys is None or queued is None:
            return self
        _, labels = queued
        kept = ~torch.isin(labels, keys.to(labels.device))
        return MemoryBank(
            *(None if part is None else part[kept] for part in (self.embeddings, self.labels, self.document_ids))
        )


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
    queued = bank.queued()
    if queued is None:
        return None, None
    queued_embeddings, queued_labels = queued
    check_fits(queued_embeddings, embeddings)
    return queued_embeddings.to(device=embeddings.device, dtype=embeddings.dtype), queued_labels.to(embeddings.device)


def enqueue(
    bank: MemoryBank, embeddings: Tensor, labels: Tensor, memory_size: int, document_ids: Tensor | None = None
) -> MemoryBank:
    """A new bank: the old rows followed by these (detached, in the bank's dtype, on their own device),
    keeping the newest ``memory_size``."""
    new = [embeddings.detach(), labels.detach()] + ([] if document_ids is None else [document_ids.detach()])
    if any(len(part) != len(new[0]) for part in new[1:]):
        raise ValueError(f"{len(embeddings)} embeddings to enqueue but {len(labels)} labels.")
    queued = bank.queued()
    old: list[Tensor]
    if queued is not None:
        queued_embeddings, queued_labels = queued
        queued_ids = bank.document_ids
        check_fits(queued_embeddings, embeddings)
        if (queued_ids is None) != (document_ids is None):
            raise ValueError("Rows with and without document ids cannot share a cross-batch memory.")
        if document_ids is not None and queued_ids is not None and queued_ids.shape[1:] != document_ids.shape[1:]:
            raise ValueError(
                f"The cross-batch memory holds {queued_ids.shape[1]} document key(s) per row and this step "
                f'{document_ids.shape[1]}: document_ids="text" and ids from the labels cannot share a memory; call '
                "reset_memory() when switching."
            )
        old = [queued_embeddings, queued_labels] + ([] if queued_ids is None else [queued_ids])
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
