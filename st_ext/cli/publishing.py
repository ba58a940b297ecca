"""Publish a run's results over an earlier run's so that a kill or a full disk leaves one of the two whole.

``st-ext train`` writes everything a run produces (``model/``, ``metrics.json``, the CSV, the plots)
into a hidden staging folder inside the output directory. Nothing there is touched until the
staging folder is complete and marked so; then:

    1. every earlier entry of the same name is moved into a hidden ``.run.previous`` folder;
    2. every staged entry is moved into the output directory;
    3. ``.run.previous`` and the emptied staging folder are deleted.

Each move is a rename within one file system, which a kill cannot split. :func:`recover` (run before
the next run writes anything) reads what a killed run left: a marked staging folder is published
(steps 1 to 3, for what is still staged); an unmarked one is deleted, and entries moved aside
without a complete run to replace them are moved back. The output directory therefore always holds
one run's results, never a mix: a run that fails to write (a full disk) leaves the earlier results
as they were. Files the user put in the output directory under other names are never touched.
Stale trainer folders (``.trainer-*``, where the trainer writes while it runs) are deleted too.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

#: Written into a staging folder once everything in it is written.
COMPLETE_MARK = ".complete"
STAGING_PREFIX = ".run.staging-"
PREVIOUS = ".run.previous"
TRAINER_PREFIX = ".trainer-"


def _no_fault(step: str) -> None:
    """Where a test injects a kill: called after each step of the swap with the step's name."""


#: Replaced by tests to simulate a kill between the steps of :func:`publish`.
fault_point: Callable[[str], None] = _no_fault


def _hidden_folder(output_dir: Path, prefix: str) -> Path:
    """A new hidden folder in ``output_dir`` with the user's umask (``mkdtemp`` would make it 0700)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=output_dir))
    folder.rmdir()
    folder.mkdir()
    return folder


def staging_folder(output_dir: Path) -> Path:
    """A new hidden folder in ``output_dir`` to write a run's results into."""
    return _hidden_folder(output_dir, STAGING_PREFIX)


def trainer_folder(output_dir: Path) -> Path:
    """A new hidden folder in ``output_dir`` for the trainer's own files while it runs; delete it after."""
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
