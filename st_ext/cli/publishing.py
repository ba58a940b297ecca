"""Publish a folder over an older one so that a kill at any moment leaves one of the two whole.

``st-ext train`` writes its model into a hidden staging folder beside the target and marks it
complete; then the swap is two renames and a delete, each of which a kill may interrupt:

    1. the old ``model/`` is renamed aside to ``.model.previous``;
    2. the complete staging folder is renamed to ``model/``;
    3. ``.model.previous`` is deleted.

:func:`recover` (run before the next run writes anything) reads what a killed swap left: a
staging folder with its mark is swapped in (the run that wrote it had finished); without one, a
folder moved aside is put back; after 2, the old folder is deleted; unmarked staging folders are
deleted. Renames within one directory are atomic on POSIX file systems, so ``model/`` is always
either the old model or the new one, or (between 1 and 2) absent with both kept beside it.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Callable

#: Written into a staging folder once everything in it is written.
COMPLETE_MARK = ".complete"


def _no_fault(step: str) -> None:
    """Where a test injects a kill: called after each step of the swap with the step's name."""


#: Replaced by tests to simulate a kill between the steps of :func:`publish`.
fault_point: Callable[[str], None] = _no_fault


def staging_folder(target: Path) -> Path:
    """A new hidden folder beside ``target`` to write into (it gets the user's umask, like ``mkdir``)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.staging-", dir=target.parent))
    staging.rmdir()
    staging.mkdir()
    return staging


def aside(target: Path) -> Path:
    return target.with_name(f".{target.name}.previous")


def publish(staging: Path, target: Path) -> Path:
    """Swap the fully written ``staging`` folder in as ``target``; the old ``target`` survives any kill
    until the new one is in place."""
    (staging / COMPLETE_MARK).touch()
    fault_point("marked")
    previous = aside(target)
    if previous.exists():
        shutil.rmtree(previous)
    if target.exists():
        target.rename(previous)
    fault_point("moved aside")
    staging.rename(target)
    (target / COMPLETE_MARK).unlink()
    fault_point("moved in")
    shutil.rmtree(previous, ignore_errors=True)
    return target


def recover(target: Path) -> list[str]:
    """Finish or roll back a swap that a kill interrupted, and delete stale staging folders; returns
    one line per thing done."""
    done: list[str] = []
    parent, previous = target.parent, aside(target)
    if not parent.is_dir():
        return done
    staged = sorted(parent.glob(f".{target.name}.staging-*"))
    complete = [folder for folder in staged if (folder / COMPLETE_MARK).exists()]
    if complete:
        newest = complete[-1]
        staged.remove(newest)
        if target.exists():
            if previous.exists():
                shutil.rmtree(previous)
            target.rename(previous)
        newest.rename(target)
        (target / COMPLETE_MARK).unlink()
        done.append(f"finished publishing {target} (a run was stopped while swapping it in)")
    if not target.exists() and previous.exists():
        previous.rename(target)
        done.append(f"restored the previous {target} (a run was stopped before its new one was complete)")
    elif previous.exists():
        shutil.rmtree(previous)
        done.append(f"deleted the previous {target.name} left beside the new one")
    if target.exists() and (target / COMPLETE_MARK).exists():
        (target / COMPLETE_MARK).unlink()
    for folder in staged:
        shutil.rmtree(folder, ignore_errors=True)
        done.append(f"deleted the unfinished {folder.name}")
    return done
