"""MultipleNegativesRankingLoss's scoring where upstream's cannot go: candidates masked per anchor (their
document is the anchor's) and earlier anchors among the candidates (a cross-batch query bank).

Upstream's ``calculate_loss`` scores one candidate set for every anchor and takes its queries from the
batch alone, so neither fits through it. This function follows its formulation for the options it
supports (``scale``, ``similarity_fct``, ``directions``, ``partition_mode``, ``gather_across_devices``;
not hardness weighting), and with nothing masked and no query bank gives its value and gradients:

* ``query_to_doc``: each anchor against every document (the batch's, every rank's when gathered, the
  queued ones); its own positive is the target.
* ``query_to_query``: against every other anchor, and the queued anchors.
* ``doc_to_query``: each positive against every anchor, and the queued anchors.
* ``doc_to_doc``: each positive against every document but its own row's.

A candidate that shares a document key with the anchor (:mod:`st_ext.losses.same_document`) is masked in
every direction, except the anchor's own positive and, in ``doc_to_query``, the anchor itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from inspect import getattr_static
from typing import cast

import torch
from torch import Tensor, nn

from st_ext._compat import all_gather_with_grad, get_rank, upstream_loss_class
from st_ext.losses.chunked_backward import backward_from_leaves, chunk_leaves, chunk_value
from st_ext.losses.gathering import gather_from_ranks
from st_ext.losses.gradcache import chunked_rows
from st_ext.losses.loss_functions import Reps
from st_ext.losses.same_document import NO_DOCUMENT, same_document

#: The directions this scoring knows (upstream's four).
DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")


@dataclass(frozen=True)
class CandidateIds:
    """Document keys of one batch's candidates (this rank's rows; gathered with the embeddings), each
    ``(rows, width)`` (:mod:`st_ext.losses.same_document`).

    ``anchors``: each anchor row's keys, also those of the anchors as candidates; ``columns``: per document
    column of the batch, the keys of each of its rows; ``queued_documents``/``queued_queries``: the keys of
    the queued rows (already every rank's).
    """

    anchors: Tensor
    columns: list[Tensor]
    queued_documents: Tensor
    queued_queries: Tensor

    @classmethod
    def unmasked(cls, rows: int, columns: int, queued_documents: int, queued_queries: int, device) -> CandidateIds:
        def none(count: int) -> Tensor:
            return torch.full((count, 1), NO_DOCUMENT, dtype=torch.int64, device=device)

        return cls(none(rows), [none(rows) for _ in range(columns)], none(queued_documents), none(queued_queries))


def check_scoring_options(loss: nn.Module, owner: str) -> None:
    """Refuse, at construction, the options of ``loss`` this scoring does not follow."""
    if getattr(loss, "hardness_mode", None) is not None and getattr(loss, "hardness_strength", 0.0) > 0:
        raise ValueError(
            f"{owner} does not support hardness_mode/hardness_strength (masked and queued candidates carry no "
            "hardness weighting): leave them at their defaults."
        )


#: Where upstream's ranking losses score their candidates (4.x's uncached loss: in ``forward``), by class.
SCORING_METHODS = {
    "CachedMultipleNegativesRankingLoss": ("calculate_loss",),
    "MultipleNegativesRankingLoss": ("compute_loss_from_embeddings", "forward"),
}


def refuse_scoring_overrides(loss: nn.Module, owner: str) -> None:
    """Refuse, at construction, a subclass whose own scoring this function would skip on every batch."""
    for class_name, methods in SCORING_METHODS.items():
        upstream_class = upstream_loss_class(class_name)
        if upstream_class is not None and isinstance(loss, upstream_class):
            mine = [
                name
                for name in methods
                if getattr_static(type(loss), name, 0) is not getattr_static(upstream_class, name, 0)
            ]
            if mine:
                raise TypeError(
                    f"{owner} scores the candidates itself, so {type(loss).__name__}'s override of {', '.join(mine)} "
                    "would never run: drop the override, or the option."
                )
            return


def masked_ranking_loss(
    loss: nn.Module, reps: Reps, ids: CandidateIds, *, chunk_size: int, with_backward: bool
) -> Tensor:
    """The ranking loss of ``loss``'s settings over ``reps``: the anchors, the batch's document columns
    (``len(ids.columns)``), then the queued documents and the queued anchors (detached; either may have no
    rows). ``chunk_size`` anchors are scored at a time; with ``with_backward`` each chunk back-propagates
    into ``reps`` and the value comes back detached."""
    columns = len(ids.columns)
    if len(reps) != columns + 3:
        raise ValueError(f"Expected anchors, {columns} document column(s) and two queued columns; got {len(reps)}.")
    queries, *documents = (torch.cat(column) for column in reps[: columns + 1])
    queued_documents, queued_queries = (torch.cat(column) for column in reps[columns + 1 :])
    anchor_ids, column_ids = ids.anchors, list(ids.columns)
    batch_size, offset = len(queries), 0
    if getattr(loss, "gather_across_devices", False):
        gather = all_gather_with_grad()
        assert gather is not None, "the loss refuses gather_across_devices where upstream lacks all_gather_with_grad"
        queries, documents = gather(queries), [gather(column) for column in documents]
        anchor_ids, column_ids = gather_from_ranks(anchor_ids), [gather_from_ranks(c) for c in column_ids]
        offset = get_rank() * batch_size
    world_batch_size = len(queries)

    graph_ends = [queries, *documents]
    leaves = chunk_leaves(graph_ends, with_backward)
    queries, *documents = leaves
    device = queries.device
    all_documents = torch.cat([*documents, queued_documents.to(queries.dtype)])
    all_queries = torch.cat([queries, queued_queries.to(queries.dtype)])
    document_ids = torch.cat([*column_ids, ids.queued_documents]).to(device)
    query_ids = torch.cat([anchor_ids, ids.queued_queries]).to(device)
    directions = tuple(getattr(loss, "directions", ("query_to_doc",)))
    per_direction = getattr(loss, "partition_mode", "joint") == "per_direction"

    similarity = cast(Callable[[Tensor, Tensor], Tensor], loss.similarity_fct)
    scale = cast(float, loss.scale)
    total = torch.zeros((), device=device)
    for begin, end in chunked_rows(batch_size, chunk_size):
        rows = torch.arange(end - begin, device=device)
        own = offset + begin + rows  # the chunk's rows among the gathered ones
        own_ids = anchor_ids.to(device)[own]
        local_queries, local_positives = queries[own], documents[0][own]

        to_documents = same_document(own_ids, document_ids)
        to_documents[rows, own] = False
        to_queries = same_document(own_ids, query_ids)
        scores = {"query_to_doc": similarity(local_queries, all_documents).masked_fill(to_documents, -torch.inf)}
        if "query_to_query" in directions:
            masked = to_queries.clone()
            masked[rows, own] = True
            scores["query_to_query"] = similarity(local_queries, all_queries).masked_fill(masked, -torch.inf)
        if "doc_to_query" in directions:
            masked = to_queries.clone()
            masked[rows, own] = False
            scores["doc_to_query"] = similarity(all_queries, local_positives).T.masked_fill(masked, -torch.inf)
        if "doc_to_doc" in directions:
            masked = to_documents.clone()
            for column in range(columns):
                masked[rows, column * world_batch_size + own] = True
            scores["doc_to_doc"] = similarity(all_documents, local_positives).T.masked_fill(masked, -torch.inf)
        scores = {direction: matrix * scale for direction, matrix in scores.items()}

        positive_scores = scores["query_to_doc"][rows, own]
        if per_direction:
            log_z = sum(torch.logsumexp(matrix, dim=1) for matrix in scores.values()) / len(scores)
        else:
            log_z = torch.logsumexp(torch.cat(list(scores.values()), dim=1), dim=1)
        chunk_loss = -(positive_scores - log_z).mean() * (end - begin) / batch_size
        total = total + chunk_value(chunk_loss, with_backward)

    if with_backward:
        backward_from_leaves(graph_ends, leaves)
    return total
