"""Retrieval metrics at every Matryoshka dimension, by sentence-transformers' ``InformationRetrievalEvaluator``.

One evaluator per dimension (``truncate_dim``), named ``dim_<d>``, so the saved model's card reports what
``metrics.json`` holds. Query ``i``'s relevant document is document ``i``; identical documents are one
corpus entry, relevant to each of their queries.
"""

from __future__ import annotations

from tqdm.auto import tqdm

from st_ext._compat import information_retrieval_evaluator

METRICS = ("mrr@10", "ndcg@10", "recall@1", "recall@5", "recall@10")


def retrieval_evaluators(queries: list[str], documents: list[str], dims: list[int], batch_size: int = 64) -> dict:
    """``{dim: InformationRetrievalEvaluator}`` for each dim in ``dims``, over the pairs ``(queries[i], documents[i])``."""
    if len(queries) != len(documents):
        raise ValueError(
            f"Need one relevant document per query: got {len(queries)} queries and {len(documents)} documents."
        )
    document_ids: dict[str, str] = {}
    for document in documents:
        document_ids.setdefault(document, f"d{len(document_ids)}")
    query_set = {f"q{i}": query for i, query in enumerate(queries)}
    corpus = {document_id: document for document, document_id in document_ids.items()}
    relevant = {f"q{i}": {document_ids[document]} for i, document in enumerate(documents)}
    evaluator_class = information_retrieval_evaluator()
    return {
        dim: evaluator_class(
            query_set,
            corpus,
            relevant,
            mrr_at_k=[10],
            ndcg_at_k=[10],
            accuracy_at_k=[1, 5, 10],
            precision_recall_at_k=[1, 5, 10],
            batch_size=batch_size,
            name=f"dim_{dim}",
            truncate_dim=dim,
            write_csv=False,
        )
        for dim in sorted(set(dims), reverse=True)
    }


def evaluate(
    model, evaluators: dict, epoch: float = -1, steps: int = -1, progress: str | None = None
) -> dict[int, dict[str, float]]:
    """``{dim: {metric: value}}`` for :data:`METRICS`; ``epoch``/``steps`` label them in the model card's log.
    ``progress`` names a bar that advances as each dimension is evaluated (none when None)."""
    results = {}
    for dim, evaluator in tqdm(evaluators.items(), desc=progress, unit="dim", disable=progress is None):
        scores = evaluator(model, epoch=epoch, steps=steps)
        # e.g. "dim_384_cosine_ndcg@10": the evaluator's name and the model's similarity function prefix every key.
        prefix = evaluator.primary_metric.removesuffix("ndcg@10")
        results[dim] = {metric: float(scores[prefix + metric]) for metric in METRICS}
    return results


def format_table(before: dict[int, dict[str, float]], after: dict[int, dict[str, float]] | None = None) -> str:
    """A fixed-width table: one row per dim, metric columns (``before -> after`` when both are given)."""
    width = 16 if after else 9
    lines = [f"{'dim':>5} | " + " ".join(f"{m:>{width}}" for m in METRICS)]
    for dim in sorted(before, reverse=True):
        cells = (f"{before[dim][m]:.3f}" + (f" -> {after[dim][m]:.3f}" if after else "") for m in METRICS)
        lines.append(f"{dim:>5} | " + " ".join(f"{cell:>{width}}" for cell in cells))
    return "\n".join(lines)
