"""The ``st-ext`` command (also ``python -m st_ext``) and its parser.

``st-ext train`` with no arguments trains the packaged all-MiniLM-L6-v2 on the built-in pairs.
transformers' ``HfArgumentParser`` makes every :class:`st_ext.cli.job.TrainConfig` field a flag
(``--batch-size 64``, or ``--batch_size 64``) whose help shows its default. ``--config`` reads the same
settings from a YAML or JSON file (``batch_size: 64``); they become the parser's defaults, so flags win
over the file. A bad setting ends the command with one line saying what to fix and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml
from transformers import HfArgumentParser

from st_ext.cli.job import ConfigError, TrainConfig, run
from st_ext.cli.settings import SettingError, convert_settings
from st_ext.losses.registry import describe_losses

EXIT_BAD_INPUT = 2


def positive_or_auto(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {value!r}") from None


def build_parser(train_defaults: dict | None = None) -> argparse.ArgumentParser:
    """``st-ext`` and its ``train`` command; ``train_defaults`` (from a config file) replace the fields' defaults."""
    parser = argparse.ArgumentParser(prog="st-ext", description="Memory-bounded sentence-transformers training.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=HfArgumentParser)
    train = commands.add_parser(
        "train",
        dataclass_types=TrainConfig,
        help="train a SentenceTransformer (default: the packaged all-MiniLM-L6-v2 on built-in pairs)",
        description="Every setting below is also a key of the --config file (with _ for -); flags win over the file.",
    )
    # HfArgumentParser parses Union[int, str] as int; the mini-batch size may also be 'auto'.
    train._option_string_actions["--mini-batch-size"].type = positive_or_auto
    train.add_argument("--config", type=Path, default=None, help="YAML or JSON file of settings: keys as the flags, with _ for -")
    train.add_argument(
        "--list-losses", action="store_true", help="print each registered loss with its input columns and exit"
    )
    if train_defaults:
        train.set_defaults(**train_defaults)
    return parser


def load_config_file(path: Path) -> dict:
    """Settings from a YAML/JSON file: a mapping whose keys are TrainConfig fields."""
    if path.is_dir():
        raise ConfigError(f"config: {path} is a directory; pass a YAML or JSON file.")
    if not path.is_file():
        raise ConfigError(f"config: {path} does not exist.")
    text = path.read_text()
    try:
        if path.suffix.lower() == ".json":
            settings = json.loads(text)
        else:
            settings = yaml.safe_load(text)
    except Exception as error:  # json and yaml raise their own error types
        raise ConfigError(f"config: {path} is not valid {path.suffix.lstrip('.').upper() or 'YAML'}: {error}") from error
    if settings is None:
        return {}
    if not isinstance(settings, dict):
        raise ConfigError(f"config: {path} must hold a mapping of settings, not a {type(settings).__name__}.")
    settings = {str(k).replace("-", "_"): v for k, v in settings.items()}
    unknown = sorted(set(settings) - set(TrainConfig.field_names()))
    if unknown:
        raise ConfigError(f"config: unknown setting(s) {', '.join(unknown)}; known: {', '.join(TrainConfig.field_names())}.")
    try:
        return convert_settings(TrainConfig, settings, "config")
    except SettingError as error:
        raise ConfigError(str(error)) from None


#: argparse names the command this way in its own errors ("st-ext train: error: ..."); st_ext's say the same.
ERROR_PREFIX = "st-ext train: error:"
EXIT_INTERRUPTED = 130


def main(argv: list[str] | None = None) -> int:
    namespace = build_parser().parse_args(argv)
    try:
        if namespace.list_losses:
            print("\n".join(describe_losses()))
            return 0
        if namespace.config is not None:  # again, with the file's settings as the defaults the flags override
            namespace = build_parser(load_config_file(namespace.config)).parse_args(argv)
        run(TrainConfig(**{name: getattr(namespace, name) for name in TrainConfig.field_names()}))
    except ConfigError as error:
        print(f"{ERROR_PREFIX} {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(
            f"st-ext train: interrupted; nothing was written to {namespace.output_dir}: it holds the previous "
            "run's results, if any.",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
