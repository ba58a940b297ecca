"""The one scoring a cross-batch memory (and ``document_ids``) trains with equals upstream's MNRL when nothing is masked.

``masked_ranking_loss`` stands in for upstream's scoring on every step of a memory, so with no queued rows and
no ids it must give upstream's value and gradients for every ``directions`` and ``partition_mode`` the installed
release has (4.x: query to document only), with and without hard negatives, at any chunk size.
"""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch

from st_ext._compat import st_losses
from st_ext.losses.masked_ranking import CandidateIds, masked_ranking_loss

upstream = st_losses()
ROWS, DIM = 6, 8
HAS_DIRECTIONS = "directions" in inspect.signature(upstream.MultipleNegativesRankingLoss).parameters
OTHER_DIRECTIONS = ("query_to_query", "doc_to_query", "doc_to_doc")


def settings() -> list[dict]:
    if not HAS_DIRECTIONS:
        return [{}]
    every = [
        {"directions": ("query_to_doc", *others), "partition_mode": mode}
        for count in range(len(OTHER_DIRECTIONS) + 1)
        for others in itertools.combinations(OTHER_DIRECTIONS, count)
        for mode in ("joint", "per_direction")
    ]
    # Upstream refuses one softmax per direction where a direction's candidates cannot hold the positive.
    return [
        options
        for options in every
        if options["partition_mode"] == "joint" or not {"query_to_query", "doc_to_doc"} & set(options["directions"])
    ]


class ColumnLookup(torch.nn.Module):
    """A stand-in model whose "features" name a column of given embeddings: upstream's own forward scores them."""

    def __init__(self, columns: list[torch.Tensor]) -> None:
        super().__init__()
        self.columns = columns

    def forward(self, features: dict) -> dict:
        return {"sentence_embedding": self.columns[features["column"]]}


def upstream_loss(options: dict, columns: list[torch.Tensor]) -> torch.Tensor:
    """Upstream's MNRL over ``columns``: its ``compute_loss_from_embeddings`` (5.x on), else its forward (4.x)."""
    loss = upstream.MultipleNegativesRankingLoss(ColumnLookup(columns), **options)
    if hasattr(loss, "compute_loss_from_embeddings"):
        return loss.compute_loss_from_embeddings(columns, None)
    return loss([{"column": index} for index in range(len(columns))], None)


def value_and_grads(score, columns: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [column.detach().clone().requires_grad_() for column in columns]
    value = score(leaves)
    value.backward()
    return value.detach(), [leaf.grad for leaf in leaves]


@pytest.mark.parametrize(
    "options", settings(), ids=lambda o: "-".join([*o.get("directions", ()), o.get("partition_mode", "")])
)
@pytest.mark.parametrize("negatives", [0, 1])
@pytest.mark.parametrize("chunk_size", [2, ROWS])
def test_nothing_masked_is_upstreams_loss(options, negatives, chunk_size):
    loss = upstream.MultipleNegativesRankingLoss(ColumnLookup([]), **options)
    generator = torch.Generator().manual_seed(0)
    columns = [torch.randn(ROWS, DIM, generator=generator) for _ in range(2 + negatives)]
    ids = CandidateIds.unmasked(ROWS, 1 + negatives, 0, 0, "cpu")
    nothing_queued = [[torch.zeros(0, DIM)], [torch.zeros(0, DIM)]]

    def masked(leaves):
        return masked_ranking_loss(
            loss, [[leaf] for leaf in leaves] + nothing_queued, ids, chunk_size=chunk_size, with_backward=False
        )

    expected_value, expected_grads = value_and_grads(lambda leaves: upstream_loss(options, leaves), columns)
    actual_value, actual_grads = value_and_grads(masked, columns)
    torch.testing.assert_close(actual_value, expected_value)
    for actual, expected in zip(actual_grads, expected_grads):
        torch.testing.assert_close(actual, expected)
