"""The rows ``st-ext train`` trains and evaluates on (anchor, positive, hard negatives): from a local file,
a Hub dataset, or the built-in pairs. Every value is checked to be text and every file problem is named
by its line, before a model is loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from st_ext.cli.demo_data import stdlib_pairs
from st_ext.cli.errors import ConfigError
from st_ext.cli.hub import load_dataset_from_hub, looks_like_hub_id

DATA_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
#: How many of the built-in pairs the demo trains on unless told otherwise (a few minutes on a CPU).
DEMO_PAIRS = 600
#: Fewer rows than this and a run cannot train and evaluate at all.
MIN_ROWS = 10


@dataclass(frozen=True)
class Columns:
    """Which source columns hold the anchor, the positive and the hard negatives."""

    anchor: str = "anchor"
    positive: str = "positive"
    negatives: tuple[str, ...] = ()

    def source(self) -> list[str]:
        return [self.anchor, self.positive, *self.negatives]

    def training(self) -> list[str]:
        """The names the rows get: anchor, positive, then negative (or negative_1, negative_2, ...)."""
        if len(self.negatives) == 1:
            return ["anchor", "positive", "negative"]
        return ["anchor", "positive", *(f"negative_{i}" for i in range(1, len(self.negatives) + 1))]


@dataclass
class Rows:
    rows: list[dict[str, str]]
    skipped: int = 0


def check_data_path(setting: str, name: str) -> None:
    """A local data file that can be read, or a name that can only be a Hub dataset."""
    path = Path(name)
    if path.is_dir():
        raise ConfigError(f"{setting}: {name!r} is a directory; pass a JSONL, CSV or Parquet file.")
    if path.is_file():
        if path.suffix.lower() not in DATA_FORMATS:
            raise ConfigError(
                f"{setting}: {path.suffix!r} files are not supported; use one of {', '.join(DATA_FORMATS)}."
            )
        try:  # now, not after the model loads: one line here, a traceback then
            with open(path, "rb"):
                pass
        except OSError as error:
            raise ConfigError(
                f"{setting}: cannot read {path} ({error.strerror or error}); check its permissions."
            ) from None
        return
    if path.suffix.lower() in DATA_FORMATS or not looks_like_hub_id(name):
        raise ConfigError(f"{setting}: {name!r} does not exist.")


def read_rows(name: str, columns: Columns, setting: str = "data") -> Rows:
    """Every row of a local file or Hub dataset with all of ``columns`` filled (the others are counted)."""
    path = Path(name)
    if path.is_file():
        _check_text_file(path, setting)
        try:
            from datasets import load_dataset

            dataset = load_dataset(DATA_FORMATS[path.suffix.lower()], data_files=str(path), split="train")
        except Exception as error:  # the datasets library raises many types for unreadable files
            raise ConfigError(
                f"{setting}: cannot read {path}: {str(error).strip() or type(error).__name__}"
            ) from error
        label = path.name
    else:
        dataset, label = load_dataset_from_hub(name), name
    source = columns.source()
    missing = [column for column in source if column not in dataset.column_names]
    if missing:
        raise ConfigError(
            f"{setting}: column(s) {', '.join(missing)} not in {label} (it has: {', '.join(dataset.column_names) or 'none'}); "
            "pass --anchor-column/--positive-column/--negative-columns."
        )
    rows, skipped = [], 0
    names = columns.training()
    for number, values in enumerate(zip(*(dataset[column] for column in source)), start=1):
        for column, value in zip(source, values):
            if value is not None and not isinstance(value, str):
                raise ConfigError(
                    f"{setting}: {label} row {number}: column {column!r} holds {type(value).__name__} {value!r:.60}, "
                    "not text; every anchor, positive and negative must be a string."
                )
        if all(values):
            rows.append(dict(zip(names, values)))
        else:
            skipped += 1
    if not rows:
        raise ConfigError(f"{setting}: {label} has no rows with all of {', '.join(map(repr, source))} filled.")
    return Rows(rows, skipped)


def training_rows(data: str | None, columns: Columns, max_pairs: int | None) -> Rows:
    """The rows to train (and, without an eval file, evaluate) on; ``max_pairs`` caps them."""
    limit: int | None
    if data is None:
        found = Rows(stdlib_pairs())
        limit = DEMO_PAIRS if max_pairs is None else max_pairs
    else:
        found = read_rows(data, columns)
        limit = max_pairs
    if limit:
        found.rows = found.rows[:limit]
    if len(found.rows) < MIN_ROWS:
        raise ConfigError(f"data: {len(found.rows)} usable pairs; need at least {MIN_ROWS} to train and evaluate.")
    return found


def _check_text_file(path: Path, setting: str) -> None:
    """An empty file, bytes that are not UTF-8, (JSON Lines) a line that is not JSON, each named by line, or
    (CSV) a header without rows: the datasets library reports these without a place, or not at all."""
    if path.stat().st_size == 0:
        raise ConfigError(f"{setting}: {path} is empty.")
    if path.suffix.lower() not in (".jsonl", ".csv"):
        return
    filled_lines = 0
    with path.open("rb") as file:
        for number, raw in enumerate(file, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ConfigError(
                    f"{setting}: {path.name} line {number} is not UTF-8 (byte {error.start + 1}); save the file as UTF-8."
                ) from None
            filled_lines += bool(line.strip())
            if path.suffix.lower() == ".jsonl" and line.strip():
                try:
                    json.loads(line)
                except json.JSONDecodeError as error:
                    raise ConfigError(
                        f"{setting}: {path.name} line {number} is not valid JSON ({error.msg} at column {error.colno})."
                    ) from None
    # The datasets library's words for these are 'Instruction "train" corresponds to no data!'.
    if path.suffix.lower() == ".csv" and filled_lines == 1:
        raise ConfigError(f"{setting}: {path} has a header line and no rows; add rows below the header.")
    if filled_lines == 0:
        raise ConfigError(f"{setting}: {path} holds only blank lines; it has no rows.")
