"""Rows of every rank on every rank, without a graph: what cross-batch queues and the document ids of a
gathered batch need (embeddings that carry gradients are gathered by upstream's ``all_gather_with_grad``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def gather_from_ranks(tensor: Tensor) -> Tensor:
    """Every rank's rows, in rank order, on every rank (detached); ``tensor`` itself when not distributed.

    Ranks may hold different numbers of rows (a last, shorter batch): sizes go first, and rows travel
    padded to the largest.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensor
    tensor = tensor.detach().contiguous()
    world_size = dist.get_world_size()
    gathered_sizes = [torch.zeros(1, dtype=torch.int64, device=tensor.device) for _ in range(world_size)]
    dist.all_gather(gathered_sizes, torch.tensor([len(tensor)], dtype=torch.int64, device=tensor.device))
    sizes = [int(size) for size in gathered_sizes]
    padded = tensor.new_zeros((max(sizes), *tensor.shape[1:]))
    padded[: len(tensor)] = tensor
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(parts, padded)
    return torch.cat([part[:size] for part, size in zip(parts, sizes)])
