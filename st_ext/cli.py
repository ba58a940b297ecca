"""The ``st-ext`` command (also ``python -m st_ext``).

``st-ext train`` with no arguments trains the packaged all-MiniLM-L6-v2 on the built-in pairs.
Every :class:`st_ext.job.TrainConfig` field is a flag (``--batch-size 64``) and a key of the
optional ``--config`` file (YAML or JSON, ``batch_size: 64``); flags win over the file. A bad
setting ends the command with one line saying what to fix and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from pathlib import Path

from st_ext.job import ConfigError, TrainConfig

EXIT_BAD_INPUT = 2


def _positive_or_auto(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {value!r}") from None


def _optional(convert):
    def parse(value: str):
        return None if value.lower() in ("", "none", "null") else convert(value)

    parse.__name__ = convert.__name__
    return parse


def _bool(value: str) -> bool:
    lowered = value.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {value!r}")


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, typed from its annotation, with its default in the help."""
    hints = typing.get_type_hints(TrainConfig)
    defaults = TrainConfig()
    for item in dataclasses.fields(TrainConfig):
        flag = "--" + item.name.replace("_", "-")
        default = getattr(defaults, item.name)
        help_text = item.metadata.get("help", "")
        if default is not None:
            help_text += f" (default: {default})"
        hint = hints[item.name]
        if hint == bool:
            parser.add_argument(flag, type=_bool, nargs="?", const=True, default=argparse.SUPPRESS, help=help_text)
        elif typing.get_origin(hint) is list:
            parser.add_argument(flag, type=int, nargs="+", default=argparse.SUPPRESS, help=help_text)
        elif item.name == "mini_batch_size":
            parser.add_argument(flag, type=_positive_or_auto, default=argparse.SUPPRESS, help=help_text)
        else:
            base = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
            parser.add_argument(flag, type=_optional(base[0]), default=argparse.SUPPRESS, help=help_text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="st-ext", description="Memory-bounded sentence-transformers training.")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train",
        help="train a SentenceTransformer (default: the packaged all-MiniLM-L6-v2 on built-in pairs)",
    )
    train.add_argument("--config", type=Path, default=None, help="YAML or JSON file of settings: keys as the flags below, with _ for -")
    train.add_argument("--list-losses", action="store_true", help="print the registered loss names and exit")
    _add_config_flags(train)
    return parser


def load_config_file(path: Path) -> dict:
    """Settings from a YAML/JSON file: a mapping whose keys are TrainConfig fields."""
    if not path.is_file():
        raise ConfigError(f"config: {path} does not exist.")
    text = path.read_text()
    try:
        if path.suffix.lower() == ".json":
            settings = json.loads(text)
        else:
            import yaml

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
    return settings


def config_from_args(namespace: argparse.Namespace) -> TrainConfig:
    settings = load_config_file(namespace.config) if namespace.config else {}
    settings.update({k: v for k, v in vars(namespace).items() if k in TrainConfig.field_names()})
    return TrainConfig(**settings)


def main(argv: list[str] | None = None) -> int:
    namespace = build_parser().parse_args(argv)
    try:
        if namespace.list_losses:
            from st_ext.losses.registry import known_losses

            print("\n".join(known_losses()))
            return 0
        from st_ext.job import run

        run(config_from_args(namespace))
    except ConfigError as error:
        print(f"st-ext: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
