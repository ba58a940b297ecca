"""Back-propagating a loss scored a chunk of anchors at a time, for losses over cached embeddings.

Each chunk's backward ends at leaves detached from the embeddings' graph ends (unit vectors, an
all-gather); one final backward takes the leaves' summed gradients through that graph, which a
per-chunk backward would free after the first chunk.
"""

from __future__ import annotations

import torch
from torch import Tensor


def chunk_leaves(graph_ends: list[Tensor], with_backward: bool) -> list[Tensor]:
    """What the chunks score: detached leaves that collect their gradients, or with no backward to run, the
    graph ends themselves."""
    return [end.detach().requires_grad_() for end in graph_ends] if with_backward else graph_ends


def chunk_value(chunk_loss: Tensor, with_backward: bool) -> Tensor:
    """A chunk's loss for the total: back-propagated into the leaves now and detached, or as it is."""
    if not with_backward:
        return chunk_loss
    chunk_loss.backward()
    return chunk_loss.detach()


def backward_from_leaves(graph_ends: list[Tensor], leaves: list[Tensor]) -> None:
    """Take the gradients the chunks left on ``leaves`` back through ``graph_ends``."""
    pairs = [(end, leaf.grad) for end, leaf in zip(graph_ends, leaves) if leaf.grad is not None]
    torch.autograd.backward([end for end, _ in pairs], [grad for _, grad in pairs])
