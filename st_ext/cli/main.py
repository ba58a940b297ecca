"""The ``st-ext`` command (also ``python -m st_ext``).

``st-ext train`` with no arguments trains the packaged all-MiniLM-L6-v2 on the built-in pairs; its
settings are in :mod:`st_ext.cli.arguments`. This module imports nothing heavy, so ``st-ext --help``
and a mistyped command answer at once; torch and sentence-transformers load when ``train`` runs
(its help lists the Trainer's arguments, so it loads them too). A bad setting ends the command with
one line saying what to fix and exit status 2.
"""

from __future__ import annotations

import argparse
import sys

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
#: argparse names the command this way in its own errors ("st-ext train: error: ..."); st_ext's say the same.
ERROR_PREFIX = "st-ext train: error:"


def build_parser() -> argparse.ArgumentParser:
    """``st-ext`` and its commands; each command parses its own arguments."""
    parser = argparse.ArgumentParser(
        prog="st-ext", description="Memory-bounded sentence-transformers training.", allow_abbrev=False
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "train",
        add_help=False,
        allow_abbrev=False,
        help="train a SentenceTransformer (default: the packaged all-MiniLM-L6-v2 on built-in pairs); "
        "`st-ext train --help` lists its settings",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    namespace, rest = build_parser().parse_known_args(argv)
    if namespace.command == "train":
        return train(rest)
    raise AssertionError(f"no handler for command {namespace.command!r}")


def train(argv: list[str]) -> int:
    from st_ext.cli import job
    from st_ext.cli.arguments import parse_train_args

    output_dir = None
    try:
        namespace, config, trainer_settings = parse_train_args(argv)
        if namespace.list_losses:
            print("\n".join(job.loss_listing()))
            return 0
        output_dir = trainer_settings["output_dir"]
        job.run(config, trainer_settings, verbose=namespace.verbose)
    except job.ConfigError as error:
        print(f"{ERROR_PREFIX} {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"st-ext train: interrupted; {interrupted_summary(output_dir)}.", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def interrupted_summary(output_dir: str | None) -> str:
    """What an interrupted run left: the previous results, and the checkpoints saved so far."""
    from pathlib import Path

    from st_ext.cli.trainer_args import checkpoint_folder

    if output_dir is None:
        return "nothing was written"
    summary = f"nothing was written to {output_dir}: it holds the previous run's results, if any"
    checkpoints = checkpoint_folder(Path(output_dir))
    if any(checkpoints.glob("checkpoint-*")):
        summary += f"; the checkpoints saved so far are in {checkpoints} (resume with --resume-from-checkpoint last)"
    return summary


if __name__ == "__main__":
    sys.exit(main())
