"""``mini_batch_size: auto``: the largest GradCache mini-batch that fits a memory budget, measured.

A cached loss's peak memory is set by one mini-batch's forward and backward with grad, so the
candidate sizes (powers of two up to the batch size) are tried on real rows of the training data,
smallest first, and the search stops at the first that exceeds the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from st_ext._compat import preprocess
from st_ext.memory import measure_peak


@dataclass
class MiniBatchChoice:
    size: int
    peak_bytes: int
    budget_bytes: int
    meter: str
    tried: dict[int, int]

    def __str__(self) -> str:
        tried = ", ".join(f"{size}: {peak / 2**20:.0f} MiB" for size, peak in sorted(self.tried.items()))
        return (
            f"mini_batch_size auto -> {self.size} (peak {self.peak_bytes / 2**20:.0f} MiB of a "
            f"{self.budget_bytes / 2**20:.0f} MiB budget, {self.meter}; tried {tried})"
        )


def memory_budget(budget_mb: float | None, device: torch.device) -> int:
    """The budget in bytes: the one given, else 90% of the free CUDA memory; on CPU one must be given."""
    if budget_mb is not None:
        if budget_mb <= 0:
            raise ValueError(f"memory budget must be positive, got {budget_mb} MB.")
        return int(budget_mb * 2**20)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.9)
    raise ValueError("mini_batch_size 'auto' on CPU needs a memory budget: pass --memory-budget-mb (e.g. 2048).")


def choose_mini_batch_size(model, texts: list[str], batch_size: int, budget_bytes: int) -> MiniBatchChoice:
    """Measure candidate mini-batch sizes on ``texts`` and keep the largest whose peak fits the budget."""
    if not texts:
        raise ValueError("Cannot size mini-batches without training texts.")
    candidates = [1 << i for i in range(batch_size.bit_length()) if 1 << i <= batch_size]
    if candidates[-1] != batch_size:
        candidates.append(batch_size)
    was_training = model.training
    model.train()
    tried: dict[int, int] = {}
    meter = ""
    try:
        for size in candidates:
            rows = [texts[i % len(texts)] for i in range(size)]
            features = preprocess(model, rows, model.device)
            with measure_peak(model.device) as peak:
                model(features)["sentence_embedding"].float().pow(2).sum().backward()
            model.zero_grad(set_to_none=True)
            tried[size], meter = peak.peak_bytes, peak.meter
            if peak.peak_bytes > budget_bytes:
                break
    finally:
        model.train(was_training)
    fitting = [size for size, peak in tried.items() if peak <= budget_bytes]
    if not fitting:
        raise ValueError(
            f"Even a mini-batch of 1 needs {tried[1] / 2**20:.0f} MiB, above the {budget_bytes / 2**20:.0f} MiB "
            "budget: raise the budget, shorten max_seq_length, or enable gradient checkpointing."
        )
    size = max(fitting)
    return MiniBatchChoice(size, tried[size], budget_bytes, meter, tried)
