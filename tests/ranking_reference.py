"""MultipleNegativesRankingLoss written out by hand with torch ops, over explicit candidate sets: the
reference the query bank and same-document masking are checked against."""

from __future__ import annotations

import torch
from sentence_transformers.util import cos_sim


def ranking_loss_by_hand(
    anchors: torch.Tensor,
    documents: list[torch.Tensor],
    *,
    queued_documents: torch.Tensor | None = None,
    queued_queries: torch.Tensor | None = None,
    directions: tuple[str, ...] = ("query_to_doc",),
    partition_mode: str = "joint",
    scale: float = 20.0,
    anchor_ids: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    query_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Anchor i's target is ``documents[0][i]``. Candidates: every document (the columns, then the queued
        ones); with ``query_to_query`` every other anchor and the queued anchors; with ``doc_to_query`` (scored
        from the positive) every anchor and the queued anchors; with ``doc_to_doc`` (from the positive) every
    document but the row's own. With ids, a candidate whose id equals anchor
        i's (and >= 0) is left out of its scores, but its own positive and, from the positive, itself."""
    rows = torch.arange(len(anchors))
    empty = anchors[:0].detach()
    all_documents = torch.cat([*documents, empty if queued_documents is None else queued_documents])
    all_queries = torch.cat([anchors, empty if queued_queries is None else queued_queries])

    def masked(scores: torch.Tensor, ids: torch.Tensor | None, keep_own: bool) -> torch.Tensor:
        out = scores.clone()
        if ids is not None and anchor_ids is not None:
            same = (anchor_ids[:, None] == ids[None, :]) & (anchor_ids[:, None] >= 0)
            if keep_own:
                same[rows, rows] = False
            out = out.masked_fill(same, float("-inf"))
        return out

    blocks = {"query_to_doc": masked(cos_sim(anchors, all_documents), document_ids, keep_own=True)}
    if "query_to_query" in directions:
        to_queries = masked(cos_sim(anchors, all_queries), query_ids, keep_own=False)
        blocks["query_to_query"] = to_queries.index_put((rows, rows), torch.tensor(float("-inf")))
    if "doc_to_query" in directions:
        blocks["doc_to_query"] = masked(cos_sim(documents[0], all_queries), query_ids, keep_own=True)
    if "doc_to_doc" in directions:
        to_documents = masked(cos_sim(documents[0], all_documents), document_ids, keep_own=False)
        for column in range(len(documents)):  # the row's own documents are not its negatives
            to_documents = to_documents.index_put((rows, column * len(anchors) + rows), torch.tensor(float("-inf")))
        blocks["doc_to_doc"] = to_documents
    blocks = {name: block * scale for name, block in blocks.items()}
    positive = blocks["query_to_doc"][rows, rows]
    if partition_mode == "joint":
        log_z = torch.logsumexp(torch.cat(list(blocks.values()), dim=1), dim=1)
    else:
        log_z = sum(torch.logsumexp(block, dim=1) for block in blocks.values()) / len(blocks)
    return (log_z - positive).mean()
