"""Peak memory of one cached step of all-MiniLM-L6-v2 under each of transformers' checkpointing options.

One step of st_ext's CachedMultipleNegativesRankingLoss (forward, loss, replayed backward) per option, all in
the same run: no checkpointing, ``use_reentrant`` off (st_ext's default) and on, and where the installed
transformers has them ``every_n_layers`` and ``offload`` (offload pins host memory, so it needs an
accelerator). Memory from ``st_ext.memory.measure_peak`` (CUDA allocator when a GPU is present, else CPU
profiler events); the ratio is to the step without checkpointing.

    python benchmarks/bench_checkpointing_options.py [--batch-size 64] [--mini-batch-size 16] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from bench_checkpointing import make_batch, training_minilm

from st_ext import _compat, losses
from st_ext.memory import measure_peak, resolve_device

#: (name, torch.utils.checkpoint arguments, transformers' own options); None: checkpointing off.
OPTIONS = [
    ("off", None, None),
    ("use_reentrant=False", {"use_reentrant": False}, {}),
    ("use_reentrant=True", {"use_reentrant": True}, {}),
    ("every_n_layers=2", None, {"every_n_layers": 2}),
    ("every_n_layers=3", None, {"every_n_layers": 3}),
    ("offload=True", None, {"offload": True}),
]


def main(argv: list[str] | None = None) -> list[dict]:
    """Print the table for ``argv`` (default: the command line) and return its rows."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--mini-batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args(argv)

    device = resolve_device()
    model = training_minilm(device, args.seq_len)
    loss_fn = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=args.mini_batch_size)
    features = make_batch(model, args.batch_size, args.seq_len)
    accelerator = device.type != "cpu"
    print(f"all-MiniLM-L6-v2, batch {args.batch_size}, mini-batch {args.mini_batch_size}, seq_len {args.seq_len}, "
          f"device {device}, transformers {_compat.TRANSFORMERS_VERSION}, torch {torch.__version__}")  # fmt: skip
    rows, plain = [], None
    for name, checkpoint_kwargs, extra in OPTIONS:
        if extra is not None and (
            set(extra) - _compat.HF_CHECKPOINTING_OPTIONS or (extra.get("offload") and not accelerator)
        ):
            print(f"{name:>22} | n/a on this transformers or device")
            continue
        model.gradient_checkpointing_disable()
        if extra is not None:
            model.gradient_checkpointing_enable(checkpoint_kwargs, **extra)
        loss_fn([dict(column) for column in features], None).backward()  # warm-up: gradients allocated
        model.zero_grad(set_to_none=True)
        with measure_peak(device) as peak:
            loss_fn([dict(column) for column in features], None).backward()
        model.zero_grad(set_to_none=True)
        plain = plain or peak.peak_mib
        print(f"{name:>22} | {peak.peak_mib:>9.1f} MiB | {peak.peak_mib / plain:>5.2f}")
        rows.append({"option": name, "peak_mib": peak.peak_mib})
    model.gradient_checkpointing_disable()
    return rows


if __name__ == "__main__":
    main()
