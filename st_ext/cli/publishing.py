"""Publish a run's results over an earlier run's so that a kill or a full disk leaves one of the two whole.

A run writes everything into a hidden staging folder in the output directory and marks it complete;
then (1) each earlier entry of the same name moves into ``.run.previous``, (2) each staged entry moves
in, (3) ``.run.previous`` and the staging folder are deleted. Each move is a rename, which a kill
cannot split. :func:`recover`, before the next run writes, publishes a marked staging folder, deletes
an unmarked one and moves back what was moved aside for it, so the output directory holds one run's
results, never a mix. Other files there are never touched.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

#: Written into a staging folder once everything in it is written.
COMPLETE_MARK = ".complete"
STAGING_PREFIX = ".run.staging-"
PREVIOUS = ".run.previous"
TRAINER_PREFIX = ".trainer-"


def fault_point(step: str) -> None:
    """Called after each step of the swap with its name: where tests inject a kill."""


def _hidden_folder(output_dir: Path, prefix: str) -> Path:
    """A new hidden folder in ``output_dir`` with the user's umask (``mkdtemp`` would make it 0700)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=output_dir))
    folder.rmdir()
    folder.mkdir()
    return folder


def staging_folder(output_dir: Path) -> Path:
    return _hidden_folder(output_dir, STAGING_PREFIX)


def trainer_folder(output_dir: Path) -> Path:
    """For the trainer's own files while it runs; delete it after (:func:`recover` deletes stale ones)."""
    return _hidden_folder(output_dir, TRAINER_PREFIX)


def publish(staging: Path, output_dir: Path) -> list[Path]:
    """Put the fully written ``staging`` folder's entries in place of the earlier ones; returns their paths."""
    (staging / COMPLETE_MARK).touch()
    fault_point("marked")
    return _finish(staging, output_dir)


def _finish(staging: Path, output_dir: Path) -> list[Path]:
    entries = sorted(entry.name for entry in staging.iterdir() if entry.name != COMPLETE_MARK)
    previous = output_dir / PREVIOUS
    previous.mkdir(exist_ok=True)
    for name in entries:
        if (output_dir / name).exists() and not (previous / name).exists():
            (output_dir / name).rename(previous / name)
    fault_point("moved aside")
    for name in entries:
        (staging / name).rename(output_dir / name)
    fault_point("moved in")
    shutil.rmtree(previous, ignore_errors=True)
    shutil.rmtree(staging, ignore_errors=True)
    return [output_dir / name for name in entries]


def recover(output_dir: Path) -> list[str]:
    """Finish or roll back what a killed run left in ``output_dir``; returns one line per thing done."""
    done: list[str] = []
    if not output_dir.is_dir():
        return done
    staged = sorted(output_dir.glob(f"{STAGING_PREFIX}*"))
    complete = [folder for folder in staged if (folder / COMPLETE_MARK).exists()]
    if complete:
        newest = complete[-1]
        staged.remove(newest)
        _finish(newest, output_dir)
        done.append(f"finished publishing the results in {output_dir} (a run was stopped while putting them in place)")
    previous = output_dir / PREVIOUS
    if previous.is_dir():
        for entry in sorted(previous.iterdir()):
            if not (output_dir / entry.name).exists():
                entry.rename(output_dir / entry.name)
                done.append(f"restored the previous {entry.name} (a run was stopped before its results were complete)")
        shutil.rmtree(previous, ignore_errors=True)
    for folder in staged:
        shutil.rmtree(folder, ignore_errors=True)
        done.append(f"deleted the unfinished {folder.name}")
    for folder in sorted(output_dir.glob(f"{TRAINER_PREFIX}*")):
        shutil.rmtree(folder, ignore_errors=True)
        done.append(f"deleted the stale trainer folder {folder.name}")
    return done
