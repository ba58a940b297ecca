"""The Trainer's own arguments in ``st-ext train``: every ``SentenceTransformerTrainingArguments`` field,
under its own name, as in any ``HfArgumentParser`` script. The command changes only the defaults
(:data:`TRAINER_DEFAULTS`) and where the Trainer writes: checkpoints go to ``output_dir/checkpoints``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from transformers.trainer_utils import get_last_checkpoint

from st_ext import SentenceTransformerTrainingArguments
from st_ext.cli.errors import ConfigError

#: Where ``st-ext train`` differs from the Trainer's defaults: a demo-sized run that saves no
#: checkpoints (and, asked to, keeps the newest two: each holds the weights and AdamW's two moments,
#: 3 x 87 MiB for all-MiniLM-L6-v2), reports to no service and logs every step.
TRAINER_DEFAULTS: dict[str, Any] = {
    "output_dir": "runs/st-ext",
    "per_device_train_batch_size": 32,
    "num_train_epochs": 1.0,
    "learning_rate": 5e-5,
    "seed": 0,
    "save_strategy": "no",
    "save_total_limit": 2,
    "report_to": "none",
    "logging_steps": 1,
    "batch_sampler": "no_duplicates",
}

#: Shorter names the command also takes, as flags (``--batch-size``) and config keys, and names settings by.
ALIASES = {"batch_size": "per_device_train_batch_size", "epochs": "num_train_epochs"}

#: ``--resume-from-checkpoint last``: the newest checkpoint in ``output_dir/checkpoints``.
LAST_CHECKPOINT = "last"


def trainer_field_names() -> list[str]:
    return [field.name for field in dataclasses.fields(SentenceTransformerTrainingArguments) if field.init]


def setting_name(field_name: str) -> str:
    """The name a setting goes by in messages: its short alias where it has one."""
    return next((alias for alias, name in ALIASES.items() if name == field_name), field_name)


def training_arguments(
    settings: dict[str, Any], output_dir: str, use_cpu: bool
) -> SentenceTransformerTrainingArguments:
    """The Trainer's arguments from ``settings``, writing into ``output_dir``, on the CPU if ``use_cpu``
    or the settings say so; the arguments' own checks (bf16 without support, ...) become one line."""
    values = {**settings, "output_dir": output_dir, "use_cpu": bool(settings.get("use_cpu")) or use_cpu}
    try:
        return SentenceTransformerTrainingArguments(**values)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"trainer arguments: {' '.join(str(error).split())}") from None


def checkpoint_folder(results_dir: Path) -> Path:
    return results_dir / "checkpoints"


def resume_checkpoint(settings: dict[str, Any], results_dir: Path) -> str | None:
    """The checkpoint to resume from: ``resume_from_checkpoint`` as given, or the newest one for ``last``."""
    wanted = settings.get("resume_from_checkpoint")
    if wanted in (None, "", False):
        return None
    if wanted == LAST_CHECKPOINT:
        folder = checkpoint_folder(results_dir)
        found = get_last_checkpoint(str(folder)) if folder.is_dir() else None
        if found is None:
            raise ConfigError(
                f"resume_from_checkpoint: no checkpoint in {folder}; train with --save-strategy steps (or epoch) first, "
                "or pass a checkpoint folder."
            )
        return found
    path = Path(str(wanted))
    if not (path / "trainer_state.json").is_file():
        raise ConfigError(
            f"resume_from_checkpoint: {path} is not a checkpoint (it has no trainer_state.json); pass a checkpoint-N "
            f"folder or '{LAST_CHECKPOINT}'."
        )
    return str(path)


def checkpoint_step(checkpoint: str) -> int:
    """The optimizer step a checkpoint was saved at, from its ``trainer_state.json``."""
    state = Path(checkpoint) / "trainer_state.json"
    try:
        return int(json.loads(state.read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(
            f"resume_from_checkpoint: {state} cannot be read as the Trainer's state; pass another checkpoint-N folder."
        ) from None
