"""Which candidates come from an anchor's own document, so that they are not counted as its negatives.

A passage of the document an anchor's positive comes from (another chunk of it, the same passage paired
with another query), met in the batch, gathered from another rank or queued from an earlier step, scores
close to the positive: counted as a negative, it teaches the model to push the right answer away. Each
row names the document of its positive with an integer id (negative: none, matches nothing); a candidate
with its anchor's id is masked, except the anchor's own positive.

Where the ids come from (``document_ids`` of the losses that mask):

* ``"label"``: the dataset's label column. The ranking losses take no labels, and sentence-transformers'
  data collator hands a column named ``label`` (or ``labels``, ``score``, ``scores``) to the loss as a
  tensor; a column named, say, ``document_id`` would be tokenized and trained on as text.
* a function ``(sentence_features, labels) -> Tensor`` giving one integer per row.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from st_ext.losses.features import Features

#: ``document_ids`` as the losses take it: the label column, or a function of the batch.
DocumentIds = str | Callable[[list[Features], Tensor | None], Tensor]
LABEL_COLUMN = "label"
#: The id of a row whose document is unknown (a hard negative's, say).
NO_DOCUMENT = -1


def check_document_ids(document_ids: DocumentIds | None, owner: str) -> None:
    """Refuse, at construction, a ``document_ids`` that names no source of ids."""
    if document_ids is None or document_ids == LABEL_COLUMN or callable(document_ids):
        return
    raise ValueError(
        f'{owner}: document_ids must be "label" (the label column holds each row\'s document id), a function '
        f"(sentence_features, labels) -> one integer per row, or None; got {document_ids!r}."
    )


def batch_document_ids(
    document_ids: DocumentIds, sentence_features: list[Features], labels: Tensor | None, rows: int
) -> Tensor:
    """The document id of each of the batch's ``rows`` rows (int64)."""
    if document_ids == LABEL_COLUMN:
        if labels is None:
            raise ValueError(
                'document_ids="label" but the batch has no label column: add a "label" column holding the integer '
                "id of each row's document."
            )
        ids = labels
    else:
        ids = document_ids(sentence_features, labels)
    if not isinstance(ids, Tensor) or ids.shape != (rows,) or ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(
            f"Document ids must be one integer per row ({rows} rows), got "
            f"{tuple(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__}"
            f"{f' {ids.dtype}' if isinstance(ids, Tensor) else ''}."
        )
    return ids.to(torch.int64)


def same_document(anchor_ids: Tensor, candidate_ids: Tensor) -> Tensor:
    """``(anchors, candidates)``: True where a candidate has its anchor's document id (negative ids match nothing)."""
    anchor_ids = anchor_ids.to(candidate_ids.device)
    return (anchor_ids.unsqueeze(1) == candidate_ids.unsqueeze(0)) & (anchor_ids >= 0).unsqueeze(1)


def without_same_document(
    scores: Tensor, row_ids: Tensor | None, candidate_ids: Tensor | None, keep: tuple[Tensor, Tensor] | None = None
) -> Tensor:
    """``scores`` (rows x candidates) with -inf where a candidate has its row's document, except at the
    ``keep`` positions (the rows' targets); ``scores`` itself without ids."""
    if row_ids is None or candidate_ids is None:
        return scores
    same = same_document(row_ids, candidate_ids.to(scores.device))
    if keep is not None:
        same[keep] = False
    return scores.masked_fill(same, -torch.inf)
