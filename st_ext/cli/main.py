"""The ``st-ext`` command (also ``python -m st_ext``). This module imports nothing heavy, so ``st-ext
--help`` and a mistyped command answer at once; torch and sentence-transformers load when ``train`` runs.
A bad setting ends the command with one line saying what to fix and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


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
    commands.add_parser(
        "swap-imports",
        add_help=False,
        allow_abbrev=False,
        help="rewrite a training script's sentence-transformers imports to st_ext's (a diff by default; "
        "--in-place writes it)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    namespace, rest = build_parser().parse_known_args(argv)  # the command parses the rest
    if namespace.command == "swap-imports":
        from st_ext.cli.swap_imports import run

        return run(rest)
    return train(rest)


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
        print(f"st-ext train: error: {error}", file=sys.stderr)  # as argparse's own errors start
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"st-ext train: interrupted; {interrupted_summary(output_dir)}.", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def interrupted_summary(output_dir: str | None) -> str:
    """What an interrupted run left: the previous results, and the checkpoints saved so far."""
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
