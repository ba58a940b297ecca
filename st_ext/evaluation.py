"""Retrieval metrics at every Matryoshka dimension, from one embedding pass.

Queries and documents are embedded once at full size; each dimension truncates and re-normalises
those embeddings, so evaluating five dimensions costs one encode. Query ``i``'s relevant document
is document ``i`` (paired data), which makes every metric a function of that document's rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

METRICS = ("mrr@10", "ndcg@10", "recall@1", "recall@5", "recall@10")


def rank_of_relevant(query_embeddings: torch.Tensor, document_embeddings: torch.Tensor) -> torch.Tensor:
    """1-based rank of document ``i`` among all documents for query ``i`` (cosine similarity, ties pessimistic)."""
    if query_embeddings.shape != document_embeddings.shape:
        raise ValueError(
            f"Need one relevant document per query: got {query_embeddings.shape[0]} queries and "
            f"{document_embeddings.shape[0]} documents of dims {query_embeddings.shape[1:]}/{document_embeddings.shape[1:]}."
        )
    scores = F.normalize(query_embeddings, dim=-1) @ F.normalize(document_embeddings, dim=-1).T
    relevant = scores.diagonal().unsqueeze(1)
    return (scores >= relevant).sum(dim=1)


def metrics_from_ranks(ranks: torch.Tensor) -> dict[str, float]:
    """MRR@10, NDCG@10 (one relevant document, so IDCG is 1) and Recall@{1,5,10}."""
    ranks = ranks.double()
    within10 = ranks <= 10
    return {
        "mrr@10": torch.where(within10, 1.0 / ranks, 0.0).mean().item(),
        "ndcg@10": torch.where(within10, 1.0 / torch.log2(ranks + 1.0), 0.0).mean().item(),
        "recall@1": (ranks <= 1).double().mean().item(),
        "recall@5": (ranks <= 5).double().mean().item(),
        "recall@10": within10.double().mean().item(),
    }


def evaluate_dims(
    query_embeddings: torch.Tensor, document_embeddings: torch.Tensor, dims: list[int]
) -> dict[int, dict[str, float]]:
    """Metrics for each truncation size in ``dims`` (each at most the embedding size)."""
    full = query_embeddings.shape[1]
    results = {}
    for dim in sorted(set(dims), reverse=True):
        if not 0 < dim <= full:
            raise ValueError(f"Matryoshka dim {dim} is outside 1..{full} (the model's embedding size).")
        results[dim] = metrics_from_ranks(rank_of_relevant(query_embeddings[:, :dim], document_embeddings[:, :dim]))
    return results


def evaluate_model(model, queries: list[str], documents: list[str], dims: list[int], batch_size: int = 64, show_progress_bar: bool = True):
    """Embed ``queries`` and ``documents`` with ``model`` once and score every dim in ``dims``."""
    encode = dict(batch_size=batch_size, convert_to_tensor=True, show_progress_bar=show_progress_bar)
    query_embeddings = model.encode(queries, **encode).float().cpu()
    document_embeddings = model.encode(documents, **encode).float().cpu()
    return evaluate_dims(query_embeddings, document_embeddings, dims)


def format_table(before: dict[int, dict[str, float]], after: dict[int, dict[str, float]] | None = None) -> str:
    """A fixed-width table: one row per dim, metric columns (``before → after`` when both are given)."""
    width = 16 if after else 9
    lines = [f"{'dim':>5} | " + " ".join(f"{m:>{width}}" for m in METRICS)]
    for dim in sorted(before, reverse=True):
        cells = []
        for metric in METRICS:
            cell = f"{before[dim][metric]:.3f}"
            if after:
                cell += f" -> {after[dim][metric]:.3f}"
            cells.append(f"{cell:>{width}}")
        lines.append(f"{dim:>5} | " + " ".join(cells))
    return "\n".join(lines)

