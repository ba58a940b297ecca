"""st_ext's triplet losses against the installed sentence-transformers' and, with a memory, against
pytorch-metric-learning's CrossBatchMemory, on the same inputs in one run.

1. In-batch (no memory), per loss: forward + backward time (best of --repeats, interleaved) and peak
   memory of upstream's ``Batch{All,Hard,SemiHard}TripletLoss`` and st_ext's, plus the largest
   difference in value and gradient. Random unit embeddings, 8 texts per class.
2. With a memory of M rows (batch-all, 100 classes): st_ext's loss over batch + memory against PML's
   ``CrossBatchMemory(TripletMarginLoss)`` (the same triplets: anchors from the batch, references
   batch + memory; PML enumerates them, st_ext sums prefixes of sorted distances). Values agree;
   gradients differ by design: PML's references to the batch are its detached queue copies.

Ratios are other / st_ext (above 1: st_ext is faster or smaller). Memory is st_ext.memory's meter:
torch.profiler allocation events on CPU, ``torch.cuda.max_memory_allocated`` on CUDA.

Run by hand: ``python benchmarks/bench_triplet_losses.py [--repeats 3] [--device cpu|cuda] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import sentence_transformers
import torch

from st_ext._compat import st_losses
from st_ext.losses import triplet
from st_ext.memory import measure_peak

LOSSES = ["BatchAllTripletLoss", "BatchHardTripletLoss", "BatchSemiHardTripletLoss"]
BATCHES = [128, 512, 1024]
MEMORY_SHAPES = [(32, 1024), (64, 2048)]
EMBEDDING_SIZE = 384
MARGIN = 0.5


class Rows(torch.nn.Module):
    """A "model" returning the rows it is given, so both losses run their own forward."""

    def forward(self, features):
        return {"sentence_embedding": features["rows"]}


def unit_rows(count: int, device: torch.device, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(count, EMBEDDING_SIZE, generator=generator), dim=1).to(device)


def forward_backward(
    loss: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = rows.clone().requires_grad_()
    value = loss(leaf)
    value.backward()
    return value.detach(), leaf.grad


def seconds(function: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    function()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def best_of(functions: list[Callable[[], object]], device: torch.device, repeats: int) -> list[float]:
    """Fastest of ``repeats`` interleaved calls each, so a busy spell hits all alike."""
    best = [float("inf")] * len(functions)
    for _ in range(repeats):
        for index, function in enumerate(functions):
            best[index] = min(best[index], seconds(function, device))
    return best


def peak_mib(function: Callable[[], object], device: torch.device) -> float:
    with measure_peak(device) as peak:
        function()
    return peak.peak_mib


def in_batch_table(device: torch.device, repeats: int) -> None:
    upstream = st_losses()
    print(f"\n1. In-batch, sentence-transformers {sentence_transformers.__version__} vs st_ext, 8 texts per class")
    print(
        f"{'loss':<26}{'batch':>6}{'time up':>10}{'time st':>10}{'ratio':>7}{'MiB up':>9}{'MiB st':>9}{'ratio':>7}{'max diff':>10}"
    )
    for batch in BATCHES:
        rows, labels = unit_rows(batch, device, seed=batch), (torch.arange(batch) // 8).to(device)
        for name in LOSSES:
            theirs = getattr(upstream, name)(Rows(), margin=MARGIN)
            ours = getattr(triplet, name)(Rows(), margin=MARGIN)
            runs = [
                lambda loss=loss: forward_backward(lambda x: loss([{"rows": x}], labels), rows)
                for loss in (theirs, ours)
            ]
            (value_up, grad_up), (value_st, grad_st) = runs[0](), runs[1]()
            difference = max(
                float((value_up - value_st).abs() / value_up.abs().clamp(min=1e-12)),
                float((grad_up - grad_st).abs().max() / grad_up.abs().max().clamp(min=1e-12)),
            )
            time_up, time_st = best_of(runs, device, repeats)
            mib_up, mib_st = peak_mib(runs[0], device), peak_mib(runs[1], device)
            print(
                f"{name:<26}{batch:>6}{time_up * 1e3:>8.1f}ms{time_st * 1e3:>8.1f}ms{time_up / time_st:>7.2f}"
                f"{mib_up:>9.1f}{mib_st:>9.1f}{mib_up / max(mib_st, 1e-9):>7.1f}{difference:>10.1e}"
            )


def memory_table(device: torch.device, repeats: int) -> None:
    from pytorch_metric_learning import __version__ as pml_version
    from pytorch_metric_learning.losses import CrossBatchMemory, TripletMarginLoss

    print(f"\n2. Batch-all over batch + memory, 100 classes: pytorch-metric-learning {pml_version} vs st_ext")
    print(
        f"{'batch':>6}{'memory':>8}{'triplets':>13}{'time PML':>11}{'time st':>10}{'ratio':>7}"
        f"{'MiB PML':>10}{'MiB st':>9}{'ratio':>8}{'value diff':>12}"
    )
    for batch, memory_rows in MEMORY_SHAPES:
        rows, memory = unit_rows(batch, device, seed=1), unit_rows(memory_rows, device, seed=2)
        labels, memory_labels = (torch.arange(batch) % 100).to(device), (torch.arange(memory_rows) % 100).to(device)
        ours = triplet.BatchAllTripletLoss(Rows(), margin=MARGIN)

        def pml_loss(x: torch.Tensor) -> torch.Tensor:
            # The queue holds the memory, then the batch is enqueued (PML's order): references = batch + memory.
            xbm = CrossBatchMemory(
                TripletMarginLoss(margin=MARGIN), EMBEDDING_SIZE, memory_size=memory_rows + batch
            ).to(device)
            xbm.embedding_memory[:memory_rows] = memory
            xbm.label_memory[:memory_rows] = memory_labels
            xbm.queue_idx = memory_rows
            return xbm(x, labels)

        runs = [
            lambda: forward_backward(pml_loss, rows),
            lambda: forward_backward(
                lambda x: ours.compute_loss_from_embeddings([x], labels, memory, memory_labels), rows
            ),
        ]
        # Values only: PML detaches the batch's own rows as references (they sit in its queue), st_ext
        # back-propagates through them, so gradients differ by design.
        (value_pml, _), (value_st, _) = runs[0](), runs[1]()
        difference = float((value_pml - value_st).abs() / value_pml.abs())
        distances = triplet.triplet_distances(triplet.euclidean_distance, rows, memory)
        valid, _ = triplet.batch_all_triplet_counts(distances, labels, torch.cat([labels, memory_labels]), MARGIN)
        time_pml, time_st = best_of(runs, device, repeats)
        mib_pml, mib_st = peak_mib(runs[0], device), peak_mib(runs[1], device)
        print(
            f"{batch:>6}{memory_rows:>8}{valid:>13,}{time_pml * 1e3:>9.1f}ms{time_st * 1e3:>8.1f}ms"
            f"{time_pml / time_st:>7.1f}{mib_pml:>10.1f}{mib_st:>9.1f}{mib_pml / max(mib_st, 1e-9):>8.1f}{difference:>12.1e}"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (a busy CPU: 1)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"device: {device}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    in_batch_table(device, args.repeats)
    memory_table(device, args.repeats)


if __name__ == "__main__":
    main()
