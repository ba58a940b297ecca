"""The ``st-ext train`` parser: every field of :class:`st_ext.cli.job.TrainConfig` and of
``SentenceTransformerTrainingArguments`` is a flag (``HfArgumentParser``) and a key of the ``--config``
YAML or JSON file, whose settings become the parser's defaults, so flags win over the file.
"""

from __future__ import annotations

import argparse
import copy
import json
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from transformers import HfArgumentParser
from transformers.hf_argparser import DataClassType

from st_ext import SentenceTransformerTrainingArguments
from st_ext._compat import parser_actions, parser_option
from st_ext.cli.job import ConfigError, TrainConfig
from st_ext.cli.trainer_args import ALIASES, TRAINER_DEFAULTS, trainer_field_names


def positive_or_auto(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {value!r}") from None


class TrainParser(HfArgumentParser):
    """``HfArgumentParser`` whose errors are one line: the usage block lists some 130 settings, and
    printed before the error it buries the one line that says what is wrong."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists every setting)\n")


class OneSpellingFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help that names each flag once, as the docs spell it (``--anchor-column``); the parser also takes the
    ``--anchor_column`` spelling HfArgumentParser adds, so scripts written for either keep working."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        spellings = [flag for flag in action.option_strings if "_" not in flag]
        if spellings and len(spellings) < len(action.option_strings):
            action = copy.copy(action)
            action.option_strings = spellings
        return super()._format_action_invocation(action)


class ShowTrainerHelp(argparse.Action):
    """``--help-trainer``: the help with the Trainer's arguments too, which ``--help`` leaves out
    (``hidden_help``: each hidden action's own help, from :func:`hide_trainer_options`)."""

    def __init__(self, option_strings, dest, hidden_help: dict[argparse.Action, str | None], **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)
        self.hidden_help = hidden_help

    def __call__(self, parser, namespace, values, option_string=None):
        for action in parser_actions(parser):
            if action.dest in trainer_field_names() and action.help == argparse.SUPPRESS:
                action.help = self.hidden_help.get(action)
        parser.print_help()
        parser.exit()


def hide_trainer_options(parser: argparse.ArgumentParser) -> dict[argparse.Action, str | None]:
    """``--help`` lists st_ext's settings; the Trainer's ~120 arguments are behind ``--help-trainer``. Returns
    the help each hidden action had."""
    own = set(TrainConfig.field_names()) | set(ALIASES.values())
    hidden_help = {}
    for action in parser_actions(parser):
        if action.dest in trainer_field_names() and action.dest not in own and action.option_strings:
            hidden_help[action] = action.help
            action.help = argparse.SUPPRESS
    return hidden_help


def build_train_parser(file_settings: dict[str, Any] | None = None) -> HfArgumentParser:
    """``st-ext train``'s parser; ``file_settings`` (from a config file) replace the defaults. Flags must be
    spelt in full: among ~130 settings a prefix such as ``--anchor_colum`` would silently become another."""
    parser = TrainParser(
        (DataClassType(TrainConfig), DataClassType(SentenceTransformerTrainingArguments)),
        prog="st-ext train",
        allow_abbrev=False,
        usage="st-ext train [options]",
        formatter_class=OneSpellingFormatter,
        description=(
            "st_ext's settings, below; every argument of sentence-transformers' Trainer (checkpoints, resume, "
            "warmup, bf16, accumulation, report_to, ...) is a flag too: `st-ext train --help-trainer` lists them. "
            "Each is also a key of the --config file (with _ for -); flags win over the file."
        ),
    )
    # HfArgumentParser parses Union[int, str] as int; the mini-batch size may also be 'auto'.
    parser_option(parser, "--mini-batch-size").type = positive_or_auto
    for alias, name in ALIASES.items():
        target = parser_option(parser, "--" + name)
        # "--batch-size" and "--batch_size"; a one-word alias ("--epochs") is one flag, listed once.
        spellings = dict.fromkeys(("--" + alias.replace("_", "-"), "--" + alias))
        parser.add_argument(
            *spellings,
            dest=name,
            type=target.type,
            default=argparse.SUPPRESS,
            help=f"short for --{name.replace('_', '-')}",
        )
    parser.add_argument(
        "--config", type=Path, default=None, help="YAML or JSON file of settings: keys as the flags, with _ for -"
    )
    parser.add_argument(
        "--list-losses",
        action="store_true",
        help="print each registered loss with its input columns, marking those st-ext train can train, and exit",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="also print what goes to metrics.json only (the guide's release report) and transformers' "
        "loading and saving progress bars",
    )
    parser.add_argument(
        "--help-trainer",
        action=ShowTrainerHelp,
        hidden_help=hide_trainer_options(parser),
        help="show this help with every argument of the Trainer, and exit",
    )
    parser.set_defaults(**{**TRAINER_DEFAULTS, **(file_settings or {})})
    return parser


def parse_train_args(argv: list[str]) -> tuple[argparse.Namespace, TrainConfig, dict[str, Any]]:
    """The namespace, st_ext's settings, and the Trainer's settings (field name -> value)."""
    namespace = build_train_parser().parse_args(argv)
    if namespace.config is not None and not namespace.list_losses:
        # Again, with the file's settings as the defaults the flags override.
        namespace = build_train_parser(load_config_file(namespace.config)).parse_args(argv)
    config = TrainConfig(**{name: getattr(namespace, name) for name in TrainConfig.field_names()})
    trainer_settings = {name: getattr(namespace, name) for name in trainer_field_names()}
    return namespace, config, trainer_settings


def load_config_file(path: Path) -> dict[str, Any]:
    """Settings from a YAML/JSON file (keys as the flags' names), each converted to its field's type."""
    if path.is_dir():
        raise ConfigError(f"config: {path} is a directory; pass a YAML or JSON file.")
    if not path.is_file():
        raise ConfigError(f"config: {path} does not exist.")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"config: cannot read {path}: {getattr(error, 'strerror', None) or error}.") from None
    try:
        settings = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except Exception as error:  # json and yaml raise their own error types
        raise ConfigError(
            f"config: {path} is not valid {path.suffix.lstrip('.').upper() or 'YAML'}: {error}"
        ) from error
    if settings is None:
        return {}
    if not isinstance(settings, dict):
        raise ConfigError(f"config: {path} must hold a mapping of settings, not a {type(settings).__name__}.")
    settings = {str(key).replace("-", "_"): value for key, value in settings.items()}
    unknown = sorted(set(settings) - {*TrainConfig.field_names(), *trainer_field_names(), *ALIASES})
    if unknown:
        raise ConfigError(
            f"config: unknown setting(s) {', '.join(unknown)}; known: {', '.join(TrainConfig.field_names())}, "
            f"{', '.join(ALIASES)} and every argument of SentenceTransformerTrainingArguments."
        )
    for alias, name in ALIASES.items():
        if alias in settings and name in settings:
            raise ConfigError(f"config: {alias} and {name} are the same setting; keep one.")
    hints = {**typing.get_type_hints(SentenceTransformerTrainingArguments), **typing.get_type_hints(TrainConfig)}
    converted = {}
    for key, value in settings.items():
        name = ALIASES.get(key, key)
        converted[name] = _convert(hints[name], value, f"config: {key}")
    return converted


# A file's syntax types its values its own way (``batch_size: eight`` is text, ``learning_rate: 1e-4`` is
# text under YAML 1.1, ``batch_size:`` is None): each becomes what its flag would have read, or is refused.
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _convert(annotation: Any, value: Any, where: str) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        for option in (member for member in options if member is not type(None)):
            try:
                return _convert(option, value, where)
            except ConfigError:
                continue
        expected = " or ".join(_describe(member) for member in options)
        raise ConfigError(f"{where}: expected {expected}, got {value!r}.")
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list ({_describe(item)} each), e.g. [384, 128], got {value!r}.")
        return [_convert(item, element, where) for element in value]
    if annotation is bool:
        if isinstance(value, bool):
            return value
        word = value.strip().lower() if isinstance(value, str) else None
        if word in _TRUE + _FALSE:
            return word in _TRUE
        raise ConfigError(f"{where}: expected true or false, got {value!r}.")
    if annotation in (int, float):
        fractional = annotation is int and isinstance(value, float) and not value.is_integer()
        if not (isinstance(value, bool) or value is None or fractional):
            try:
                return annotation(value if isinstance(value, float) else str(value).strip())
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected {_describe(annotation)}, got {value!r}.")
    if annotation is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}: expected text, got {value!r}.")
    return value


def _describe(annotation: Any) -> str:
    return {int: "an integer", float: "a number", str: "text", bool: "true or false", type(None): "nothing"}.get(
        annotation, getattr(annotation, "__name__", str(annotation))
    )
