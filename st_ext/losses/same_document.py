"""Which candidates come from an anchor's own document, so that they are not counted as its negatives.

A passage of the document an anchor's positive comes from (another chunk of it, the same passage paired
with another query), met in the batch, gathered from another rank or queued from an earlier step, scores
close to the positive: counted as a negative, it teaches the model to push the right answer away.

Every text carries a few integer keys, ``(rows, width)`` int64 per column (negative: none, matches nothing),
and a candidate is from an anchor's document when any key of the anchor equals any key of the candidate
(:func:`same_document`); it is masked, except the anchor's own positive (its target). The width is fixed by
where the keys come from (``document_ids`` of the losses that mask):

* ``"label"``: the dataset's label column, one integer per row naming its positive's document (width 1).
  The ranking losses take no labels, and sentence-transformers' data collator hands a column named ``label``
  (or ``labels``, ``score``, ``scores``) to the loss as a tensor; a column named, say, ``document_id``
  would be tokenized and trained on as text.
* a function ``(sentence_features, labels) -> Tensor`` giving one integer per row (width 1).

  With either, an anchor and the candidates of its row's anchor and positive columns carry the row's id;
  a hard negative carries none.
* ``"text"``: duplicates, found by the texts themselves, with no label column. A text's key is a hash of
  its non-padding token ids (:func:`~st_ext.losses.memory_bank.document_keys`: the same in any batch, on
  any rank, at any padding). An anchor row's keys are (its anchor's key, its positive's key), and the
  candidates of its anchor and positive columns carry them: a row with the same query, or the same
  positive, is the same document. A hard negative carries its own text's key twice: one that is literally
  another row's query or positive is masked for that row's anchor (width 2). Texts are compared as the
  model's tokenizer gives them: a prompt added to one column only, or another tokenizer per column, makes
  the same words two texts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from st_ext.losses.features import Features, batch_size_of, is_flattened
from st_ext.losses.memory_bank import document_keys

#: ``document_ids`` as the losses take it: the label column, the texts, or a function of the batch.
DocumentIds = str | Callable[[list[Features], Tensor | None], Tensor]
LABEL_COLUMN = "label"
TEXT = "text"
#: The key of a text whose document is unknown (a hard negative's, with ids from the labels).
NO_DOCUMENT = -1


def check_document_ids(document_ids: DocumentIds | None, owner: str) -> None:
    """Refuse, at construction, a ``document_ids`` that names no source of ids."""
    if document_ids is None or document_ids in (LABEL_COLUMN, TEXT) or callable(document_ids):
        return
    raise ValueError(
        f'{owner}: document_ids must be "label" (the label column holds each row\'s document id), "text" (rows '
        "whose texts are identical are one document), a function (sentence_features, labels) -> one integer per "
        f"row, or None; got {document_ids!r}."
    )


def key_width(document_ids: DocumentIds) -> int:
    """How many keys each text carries with this ``document_ids``."""
    return 2 if document_ids == TEXT else 1


def batch_document_ids(
    document_ids: DocumentIds, sentence_features: list[Features], labels: Tensor | None
) -> list[Tensor]:
    """Per column of the batch (anchors, positives, hard negatives), each row's keys: ``(rows, width)`` int64."""
    if document_ids == TEXT:
        return text_keys(sentence_features)
    rows = batch_size_of(sentence_features[0])
    if isinstance(document_ids, str):  # "label" ("text" took its own path above)
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
    row_ids = ids.to(torch.int64).unsqueeze(1)
    unknown = torch.full_like(row_ids, NO_DOCUMENT)
    return [row_ids, row_ids] + [unknown] * (len(sentence_features) - 2)


def text_keys(sentence_features: list[Features]) -> list[Tensor]:
    """``document_ids="text"``: an anchor or positive carries its row's (anchor key, positive key), a hard
    negative its own key twice."""
    for column, features in enumerate(sentence_features):
        input_ids = features.get("input_ids")
        if not isinstance(input_ids, Tensor) or (input_ids.ndim != 2 and not is_flattened(features)):
            raise ValueError(
                f'document_ids="text" recognises a text by its token ids, and column {column} of this batch has no '
                'input_ids of one row per text: give each row\'s document id instead ("label" or a function).'
            )
    keys = [document_keys(features) for features in sentence_features]
    row_keys = torch.stack(keys[:2], dim=1)
    return [row_keys, row_keys] + [torch.stack([key, key], dim=1) for key in keys[2:]]


class StepDocumentIds:
    """One step's :func:`batch_document_ids`, computed at the first call: a wrapper calls the loss once per
    Matryoshka dimension or layer, always with the step's labels, and each call would hash every text again."""

    def __init__(self, document_ids: DocumentIds | None, sentence_features: list[Features]) -> None:
        self.document_ids = document_ids
        self.sentence_features = sentence_features
        self._ids: list[Tensor] | None = None

    def __call__(self, labels: Tensor | None) -> list[Tensor] | None:
        """Per column, each row's keys; None without ``document_ids``."""
        if self.document_ids is None:
            return None
        if self._ids is None:
            self._ids = batch_document_ids(self.document_ids, self.sentence_features, labels)
        return self._ids


def same_document(anchor_ids: Tensor, candidate_ids: Tensor) -> Tensor:
    """``(anchors, candidates)``: True where any key of an anchor equals any key of a candidate (negative keys
    match nothing). One ``(anchors, candidates)`` comparison per pair of key columns, never a larger temporary."""
    anchor_ids = anchor_ids.to(candidate_ids.device)
    same = torch.zeros(len(anchor_ids), len(candidate_ids), dtype=torch.bool, device=candidate_ids.device)
    for anchor_key in anchor_ids.unbind(1):
        hit = torch.zeros_like(same)
        for candidate_key in candidate_ids.unbind(1):
            hit |= anchor_key.unsqueeze(1) == candidate_key.unsqueeze(0)
        same |= hit & (anchor_key >= 0).unsqueeze(1)
    return same


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
